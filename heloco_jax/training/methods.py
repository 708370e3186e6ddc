"""The method registry: every method is data, not a copy of the training loop.

A method is (synchrony, outer rule, dispatch rule, inner variant), run by the
one engine of ``heloco_jax.runtime.engine`` (docs/DESIGN.md, "The idea in one
picture"):

  method            synchrony  outer rule (optax)                         dispatch   inner
  ddp               step       none: AdamW on gradients averaged over K    θ          plain
  local_sgd         round      optax.sgd(1): θ ← mean θ_i                  θ          plain
  diloco            round      optax.sgd(η, μ, nesterov=True)              θ          plain
  palsgd            round      optax.sgd(η, μ, nesterov=True) on θ̃         θ          palsgd
  async_nesterov    async      hj.async_nesterov                           θ          plain
  delayed_nesterov  async      hj.delayed_nesterov                         θ          plain
  mla               async      hj.mla                                      θ or look-ahead (option)
  heloco            async      hj.heloco                                   look-ahead plain
  cgad              async      hj.cgad (age-gated Adam)                    θ          plain

Default outer learning rates and momenta are those of docs/ALGORITHMS.md.
Each entry builds its own outer rule (``Method.make_outer``) and inner
optimizer (``Method.make_inner``) from keyword options, so the engine and the
CLI never branch on a method's name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import jax.numpy as jnp
import optax

from heloco_jax import outer
from heloco_jax.training import inner as inner_lib

SYNCHRONIES = ("step", "round", "async")
LOOKAHEAD = ("never", "option", "always")
# The keyword options of ``hj.heloco`` that ``Method.make_outer`` passes on.
HELOCO_OPTIONS = ("keep_threshold", "bad_threshold", "shrink_strength", "max_shrink",
                  "rotate_strength", "confidence_scale", "rotate_schedule", "weight_order",
                  "scope", "merge_order")

OuterFactory = Callable[[float, int, Mapping[str, Any]], optax.GradientTransformation]


@dataclasses.dataclass(frozen=True)
class Method:
  """One entry of the registry.

  Attributes:
    name: the method's name (``hj.simulate(method=...)``, the config's ``method``).
    synchrony: "step" (DDP: every inner step is synchronous), "round" (all
      workers start together, a barrier every H steps) or "async" (one outer
      update per arrival, no barrier).
    outer: ``(η, K, options) -> optax transform`` (None for DDP).
    lookahead: dispatch from θ − η·μ·m: "never", "option" (off by default,
      MLA) or "always" (HeLoCo).
    inner: "plain" or "palsgd" (pseudo-sync steps toward θ̃).
    reset_optimizer: the inner optimizer state is reset at every dispatch by
      default (PALSGD keeps it local).
    learning_rate: the default outer η.
    outer_keys: the keyword options of ``make_outer`` (of ``method_options``).
  """
  name: str
  synchrony: str
  outer: Optional[OuterFactory]
  lookahead: str = "never"
  inner: str = "plain"
  reset_optimizer: bool = True
  learning_rate: float = 0.7
  outer_keys: tuple[str, ...] = ()

  @property
  def run_keys(self) -> tuple[str, ...]:
    """The ``method_options`` keys that shape the method's run, not its outer rule:
    ``lookahead_dispatch`` (MLA), ``dylu`` (asynchronous methods), PALSGD's ``coins`` and
    ``warmup_steps`` (docs/ALGORITHMS.md)."""
    keys = ("lookahead_dispatch",) if self.lookahead != "never" else ()
    if self.synchrony == "async":
      keys += ("dylu",)
    if self.inner == "palsgd":
      keys += ("coins", "warmup_steps")
    return keys

  def split_options(self, options: Optional[Mapping[str, Any]]
                    ) -> tuple[Optional[dict[str, Any]], dict[str, Any]]:
    """``method_options`` as (the outer rule's keys or None, the run's keys).

    Raises:
      ValueError: a key the method does not take (a typo, or another method's), naming
        the ones it takes.
    """
    options = dict(options or {})
    allowed = self.outer_keys + self.run_keys
    unknown = sorted(set(options) - set(allowed))
    if unknown:
      raise ValueError(f"method_options key {unknown[0]!r} is not allowed with method="
                       f"{self.name!r}; allowed: {', '.join(allowed) or 'none'}")
    outer_options = {k: v for k, v in options.items() if k in self.outer_keys}
    return outer_options or None, {k: v for k, v in options.items() if k in self.run_keys}

  def make_outer(self, num_workers: int, options: Mapping[str, Any] = None
                 ) -> Optional[optax.GradientTransformation]:
    """The method's outer rule for K workers.

    Args:
      num_workers: K (for ρ = 1/√K and DN's default buffer N = K).
      options: the method's keyword options (``outer_keys``):
        ``learning_rate`` (None or absent: the method's default),
        ``momentum``, ``weighting``, DN's ``buffer_size`` (None: K) and
        ``dn_c``, and HeLoCo's ``HELOCO_OPTIONS``.

    Raises:
      ValueError: an option the method does not take (a typo, or another
        method's), naming the ones it takes.
    """
    options = dict(options or {})
    unknown = sorted(set(options) - set(self.outer_keys))
    if unknown:
      allowed = ", ".join(self.outer_keys) or "none (it has no outer rule)"
      raise ValueError(f"method_options key {unknown[0]!r} is not allowed with method="
                       f"{self.name!r}; allowed: {allowed}")
    if self.outer is None:
      return None
    learning_rate = options.get("learning_rate")
    return self.outer(self.learning_rate if learning_rate is None else learning_rate,
                      num_workers, options)

  def lookahead_dispatch(self, option: Optional[bool] = None,
                         name: str = "method_options['lookahead_dispatch']") -> bool:
    """Whether workers start from the look-ahead point (``option`` None: the default);
    errors call the option ``name``.

    Raises:
      ValueError: HeLoCo without look-ahead, or look-ahead without an MLA or
        HeLoCo momentum.
    """
    if option is None:
      return self.lookahead == "always"
    if self.lookahead == "always" and not option:
      raise ValueError(f"{name}=False is not allowed with method={self.name!r}; "
                       "allowed: None or True (it always dispatches from the look-ahead point)")
    if self.lookahead == "never" and option:
      raise ValueError(f"{name}=True is not allowed with method={self.name!r}; "
                       "allowed: methods with an MLA or HeLoCo momentum (mla, heloco)")
    return bool(option)

  def resets(self, option: Optional[bool] = None, name: str = "reset_optimizer") -> bool:
    """Whether a dispatch starts a fresh inner optimizer state (``option`` None: the method's
    default); errors call the option ``name``.

    Raises:
      ValueError: True with DDP, which has no dispatches (one optimizer state steps on every
        all-reduced gradient).
    """
    if option is None:
      return self.reset_optimizer
    if option and self.synchrony == "step":
      raise ValueError(f"{name}=True is not allowed with method={self.name!r}; allowed: None "
                       "or False (DDP has no dispatches: one optimizer state steps on every "
                       "all-reduced gradient)")
    return bool(option)

  def make_inner(self, config: inner_lib.InnerConfig) -> optax.GradientTransformation:
    """The default inner optimizer: AdamW, or PALSGD's variant of it."""
    if self.inner == "palsgd":
      config.check_pseudo_sync()
      return inner_lib.palsgd_inner(inner_lib.adamw_direction(config), config.schedule,
                                    pseudo_sync_prob=config.pseudo_sync_prob,
                                    pseudo_sync_rate=config.pseudo_sync_rate)
    return inner_lib.adamw(config)


def _async(options: Mapping[str, Any], num_workers: int) -> dict[str, Any]:
  return dict(momentum=options.get("momentum", 0.9), num_workers=num_workers,
              weighting=options.get("weighting", "constant"))


def _nesterov(learning_rate, num_workers, options):
  del num_workers
  return optax.sgd(learning_rate, momentum=options.get("momentum", 0.9), nesterov=True,
                   accumulator_dtype=jnp.float32)


def _delayed_nesterov(learning_rate, num_workers, options):
  kwargs = _async(options, num_workers)
  return outer.delayed_nesterov(learning_rate, kwargs.pop("momentum"),
                                buffer_size=(num_workers if options.get("buffer_size") is None
                                             else options["buffer_size"]),
                                c=options.get("dn_c", 0.0), **kwargs)


def _heloco(learning_rate, num_workers, options):
  kwargs = _async(options, num_workers)
  kwargs.update({key: options[key] for key in HELOCO_OPTIONS if key in options})
  return outer.heloco(learning_rate, kwargs.pop("momentum"), **kwargs)


def _cgad(learning_rate, num_workers, options):
  del num_workers  # σ(τ) replaces ρ: at τ = 0 CGAD is Adam (ALGORITHMS.md, "CGAD")
  return outer.cgad(learning_rate, b1=options.get("momentum", 0.9),
                    decay=options.get("age_decay", 0.1), cutoff=options.get("age_cutoff", 32.0))


_ASYNC_KEYS = ("learning_rate", "momentum", "weighting")
_SYNC_KEYS = ("learning_rate", "momentum")

METHODS: dict[str, Method] = {m.name: m for m in [
    Method("ddp", "step", None),
    Method("local_sgd", "round", lambda lr, k, o: optax.sgd(1.0), learning_rate=1.0),
    Method("diloco", "round", _nesterov, outer_keys=_SYNC_KEYS),
    Method("palsgd", "round", _nesterov, inner="palsgd", reset_optimizer=False,
           outer_keys=_SYNC_KEYS),
    Method("async_nesterov", "async",
           lambda lr, k, o: outer.async_nesterov(lr, **_async(o, k)), learning_rate=0.07,
           outer_keys=_ASYNC_KEYS),
    Method("delayed_nesterov", "async", _delayed_nesterov, learning_rate=0.07,
           outer_keys=_ASYNC_KEYS + ("buffer_size", "dn_c")),
    Method("mla", "async", lambda lr, k, o: outer.mla(lr, **_async(o, k)), lookahead="option",
           outer_keys=_ASYNC_KEYS),
    Method("heloco", "async", _heloco, lookahead="always",
           outer_keys=_ASYNC_KEYS + HELOCO_OPTIONS),
    Method("cgad", "async", _cgad, learning_rate=1e-3,
           outer_keys=("learning_rate", "momentum", "age_decay", "age_cutoff")),
]}


def get(name: str) -> Method:
  """The registry entry ``name``, or a ValueError listing the allowed names."""
  if name not in METHODS:
    raise ValueError(f"method={name!r} is not allowed; allowed: {', '.join(METHODS)}")
  return METHODS[name]
