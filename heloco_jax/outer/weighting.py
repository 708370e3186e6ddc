"""Arrival weight ρ of an asynchronous pseudo-gradient (ALGORITHMS.md, Notation).

  "constant"   ρ = 1/√K                (default for every asynchronous rule)
  "polynomial" ρ = (1/√K) / √(1 + τ)   τ = staleness of the arrival
  "none"       ρ = 1

With ``num_workers=None`` the weight is 1 whatever ``weighting`` says
(DESIGN.md, Public Python API). CGAD's age gate σ(τ) (``age_gate``, ``AgeGate``) is
an arrival weight of its own, defined here with the others.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable, Literal, NamedTuple, Optional, get_args

import jax
import jax.numpy as jnp
import numpy as np
import optax

from heloco_jax.outer import _validation

Weighting = Literal["constant", "polynomial", "none"]
WEIGHTINGS: tuple[str, ...] = get_args(Weighting)


def validate_weighting(fn: str, num_workers: Optional[int], weighting: Weighting) -> None:
  """Construction-time checks of ``num_workers`` and ``weighting``."""
  _validation.check_positive_int(fn, "num_workers", num_workers, allow_none=True)
  _validation.check_choice(fn, "weighting", weighting, WEIGHTINGS)


def arrival_weight(
    staleness: Any,
    *,
    num_workers: Optional[int],
    weighting: Weighting = "constant",
) -> jax.Array:
  """Returns ρ as a float32 scalar; jit- and vmap-friendly.

  Args:
    staleness: τ = (server version at arrival) − (version at dispatch), a
      Python int or an integer scalar array (batch arrivals with ``vmap``).
      Only read by ``"polynomial"``; may be None otherwise.
    num_workers: K, or None for ρ = 1.
    weighting: "constant", "polynomial" or "none".

  Returns:
    ρ, a float32 scalar.

  Raises:
    ValueError: polynomial weighting without a staleness, or a negative
      concrete staleness.

  Examples:
    >>> import heloco_jax as hj
    >>> float(hj.arrival_weight(0, num_workers=4))  # 1/√K
    0.5
    >>> float(hj.arrival_weight(3, num_workers=4, weighting="polynomial"))  # (1/√K)/√(1+τ)
    0.25
    >>> float(hj.arrival_weight(3, num_workers=None, weighting="polynomial"))
    1.0
  """
  if num_workers is None or weighting == "none":
    return jnp.ones((), jnp.float32)
  base = jnp.float32(1.0 / (num_workers ** 0.5))
  if weighting == "constant":
    return base
  if staleness is None:
    raise ValueError(
        "update: staleness=None is not allowed with weighting='polynomial'; "
        "allowed: the staleness τ >= 0 of the arrival, passed as "
        "tx.update(pseudo_grads, state, params, staleness=tau).")
  if isinstance(staleness, numbers.Integral) and staleness < 0:
    raise ValueError(
        f"update: staleness={staleness!r} is not allowed; allowed: an integer >= 0.")
  tau = jnp.asarray(staleness, jnp.float32)
  return base / jnp.sqrt(1.0 + tau)


def at_least_float32(x: Any) -> jax.Array:
  """One leaf in its compute dtype: at least float32 (bfloat16 → float32)."""
  return jnp.asarray(x, jnp.promote_types(jnp.result_type(x), jnp.float32))


def as_compute_dtype(tree: Any) -> Any:
  """Casts every leaf to at least float32."""
  return jax.tree.map(at_least_float32, tree)


def apply_arrival_weight(
    pseudo_grads: Any, staleness: Any, *, num_workers: Optional[int], weighting: Weighting,
) -> tuple[Any, jax.Array]:
  """g = ρ·Δ in float32 (or wider); returns (g, ρ)."""
  weight = arrival_weight(staleness, num_workers=num_workers, weighting=weighting)
  return jax.tree.map(lambda d: weight * d, as_compute_dtype(pseudo_grads)), weight


def staleness_array(staleness: Any) -> jax.Array:
  """The staleness as an int32 array (0 when not given), for states."""
  return jnp.asarray(0 if staleness is None else staleness, jnp.int32)


# A field of a static weight definition (``ArrivalWeighting``, ``AgeGate``) built inside a
# traced ``optax.inject_hyperparams`` init (``jax.jit(tx.init)``, as the engine does): static
# data cannot hold the tracer; the value is the state's hyperparameter of the field's name,
# which ``arrival_weighting`` reads.
INJECTED = "inject_hyperparams"


def _static(value: Any, convert: Callable[[Any], Any]) -> Any:
  return INJECTED if isinstance(value, jax.core.Tracer) else convert(value)


def _refuse_injected(definition: Any) -> None:
  if INJECTED in dataclasses.astuple(definition):
    raise ValueError(f"{definition} has an optax.inject_hyperparams hyperparameter; allowed: "
                     "arrival_weighting(state) of the state that holds it")


@dataclasses.dataclass(frozen=True)
class ArrivalWeighting:
  """ρ(τ) of a rule, as static data (no arrays): what the rule applies to each arrival.

  Every state of a rule that weighs arrivals (``scale_by_arrival_weight``,
  ``mla``, ``heloco``, ``delayed_nesterov`` and so ``async_nesterov``) carries
  its ``ArrivalWeighting``, registered with JAX as static (a pytree node with
  no leaves: it costs nothing under ``jit`` and is not checkpointed), so that
  whoever holds the state (the engine's grace window) reads ρ from the one
  place that defines it (``arrival_weighting``).

  Attributes:
    num_workers: K, None for ρ = 1, or ``INJECTED``: a K traced by
      ``optax.inject_hyperparams`` under ``jit`` (static data cannot hold a tracer), read
      from that state's hyperparameters by ``arrival_weighting``.
    weighting: "constant", "polynomial" or "none".
  """
  num_workers: Optional[int | str]
  weighting: Weighting

  def __post_init__(self):
    object.__setattr__(self, "num_workers", _static(self.num_workers, _validation.concrete_int))

  def __call__(self, staleness: Any) -> jax.Array:
    _refuse_injected(self)
    assert not isinstance(self.num_workers, str)
    return arrival_weight(staleness, num_workers=self.num_workers, weighting=self.weighting)


jax.tree_util.register_static(ArrivalWeighting)


def age_gate(staleness: Any, *, decay: float, cutoff: float) -> jax.Array:
  """CGAD's age gate σ(τ) = γ(τ)·exp(−α·τ), γ(τ) = ½(1 + cos(π·τ/τ_c)) for τ < τ_c and 0
  from τ_c on (ALGORITHMS.md, "CGAD"), as a float32 scalar; σ(0) = 1.

  Args:
    staleness: τ ≥ 0 (an int or an integer scalar array); None means 0.
    decay: α ≥ 0.
    cutoff: τ_c > 0; ``math.inf``: no gate (Adam-Decay, σ = exp(−α·τ)).

  Examples:
    >>> from heloco_jax.outer.weighting import age_gate
    >>> [round(float(age_gate(t, decay=0.0, cutoff=4.0)), 4) for t in (0, 1, 2, 4, 9)]
    [1.0, 0.8536, 0.5, 0.0, 0.0]
    >>> round(float(age_gate(2, decay=0.5, cutoff=math.inf)), 4)  # exp(-1)
    0.3679
  """
  tau = jnp.asarray(0 if staleness is None else staleness, jnp.float32)
  decayed = jnp.exp(-jnp.asarray(decay, jnp.float32) * tau)
  if isinstance(cutoff, jax.core.Tracer):  # injected: π/∞ = 0 makes the gate 1, as below
    cutoff = jnp.asarray(cutoff, jnp.float32)
    gate = jnp.where(tau < cutoff, 0.5 * (1.0 + jnp.cos(jnp.float32(math.pi) / cutoff * tau)), 0.0)
    return (gate * decayed).astype(jnp.float32)
  if math.isinf(cutoff):
    return decayed
  gate = jnp.where(tau < cutoff, 0.5 * (1.0 + jnp.cos(jnp.float32(math.pi / cutoff) * tau)), 0.0)
  return (gate * decayed).astype(jnp.float32)


def validate_age_gate(fn: str, decay: Any, cutoff: Any) -> None:
  """Construction-time checks of α (a number ≥ 0, finite in float32, where σ is computed:
  an α that is inf there makes σ(0) = exp(−∞·0) NaN) and τ_c (> 0, or ``math.inf``)."""
  _validation.check_range(fn, "decay", decay, 0.0, float(np.finfo(np.float32).max))
  if not _is_inf(cutoff):
    _validation.check_range(fn, "cutoff", cutoff, 0.0, low_open=True)


def _is_inf(value: Any) -> bool:
  """Whether ``value`` is a concrete number equal to +∞ (a float32 array too, as
  ``optax.inject_hyperparams`` passes it)."""
  if isinstance(value, (bool, str, jax.core.Tracer)):
    return False
  try:
    return float(value) == math.inf
  except (TypeError, ValueError):
    return False


@dataclasses.dataclass(frozen=True)
class AgeGate:
  """σ(τ) of CGAD's ``scale_by_age_gate``, as static data (like ``ArrivalWeighting``).

  Attributes:
    decay: α (``INJECTED``: traced by ``optax.inject_hyperparams``, as K above).
    cutoff: τ_c (``math.inf``: none; or ``INJECTED``).
  """
  decay: float | str
  cutoff: float | str

  def __post_init__(self):
    for name in ("decay", "cutoff"):
      object.__setattr__(self, name, _static(getattr(self, name), float))

  def __call__(self, staleness: Any) -> jax.Array:
    _refuse_injected(self)
    assert not isinstance(self.decay, str) and not isinstance(self.cutoff, str)
    return age_gate(staleness, decay=self.decay, cutoff=self.cutoff)


jax.tree_util.register_static(AgeGate)
WEIGHT_DEFINITIONS = (ArrivalWeighting, AgeGate)


def arrival_weighting(state: Any) -> Callable[[Any], float]:
  """ρ(τ) of the rule whose (possibly chained) state is ``state``: the product of the
  ``ArrivalWeighting``s and ``AgeGate``s it holds (1 when it holds none), as a host function
  of τ.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import heloco_jax as hj
    >>> from heloco_jax.outer.weighting import arrival_weighting
    >>> tx = hj.mla(0.7, 0.9, num_workers=4, weighting="polynomial")
    >>> rho = arrival_weighting(tx.init({"w": jnp.zeros(2)}))
    >>> rho(0), rho(3)
    (0.5, 0.25)
    >>> arrival_weighting(optax.sgd(0.1).init({"w": jnp.zeros(2)}))(3)
    1.0
  """
  found = _weight_definitions(state, {})
  def rho(staleness: Any) -> float:
    value = 1.0
    for weighting in found:
      value *= float(weighting(staleness))
    return value
  rho.weightings = tuple(found)  # type: ignore[attr-defined]
  return rho


_INJECT_STATES = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


@dataclasses.dataclass(frozen=True)
class _InjectedWeighting:
  """A weight definition with ``INJECTED`` fields and the hyperparameters that hold them."""
  definition: Any
  hyperparams: dict[str, Any]

  def __call__(self, staleness: Any) -> jax.Array:
    resolved = {f.name: self.hyperparams[f.name] for f in dataclasses.fields(self.definition)
                if getattr(self.definition, f.name) == INJECTED}
    return dataclasses.replace(self.definition, **resolved)(staleness)


def _weight_definitions(state: Any, hyperparams: dict[str, Any]) -> list[Any]:
  """The ``WEIGHT_DEFINITIONS`` in ``state``; one with ``INJECTED`` fields carries the
  hyperparameters of the ``optax.inject_hyperparams`` states around it."""
  kinds = WEIGHT_DEFINITIONS + _INJECT_STATES
  found = []
  for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kinds)):
    if isinstance(x, _INJECT_STATES):
      found += _weight_definitions(x.inner_state, {**hyperparams, **x.hyperparams})
    elif isinstance(x, WEIGHT_DEFINITIONS):
      injected = [f.name for f in dataclasses.fields(x) if getattr(x, f.name) == INJECTED]
      if any(name not in hyperparams for name in injected):
        raise ValueError(f"{injected} of {type(x).__name__} were traced outside "
                         "optax.inject_hyperparams, so ρ is unknown; allowed: Python numbers "
                         "(or inject_hyperparams' own)")
      found.append(_InjectedWeighting(x, hyperparams) if injected else x)
  return found


class ScaleByArrivalWeightState(NamedTuple):
  """ρ and τ of the last arrival, kept for logging (no host sync), and ρ's definition."""
  staleness: jax.Array
  weight: jax.Array
  rho: ArrivalWeighting


def scale_by_arrival_weight(
    num_workers: Optional[int] = None,
    weighting: Weighting = "constant",
) -> optax.GradientTransformationExtraArgs:
  """Multiplies pseudo-gradients by ρ, casting them to at least float32.

  Args:
    num_workers: K, or None for ρ = 1.
    weighting: "constant", "polynomial" or "none".

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` takes
    ``staleness=``.

  References:
    Liu et al., Asynchronous Local-SGD Training for Language Modeling,
    arXiv 2401.09135; ALGORITHMS.md (Notation, arrival weight ρ).

  Examples:
    >>> import jax.numpy as jnp
    >>> import heloco_jax as hj
    >>> tx = hj.scale_by_arrival_weight(num_workers=16, weighting="polynomial")
    >>> grads = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> updates, state = tx.update(grads, tx.init(grads), staleness=3)
    >>> str(updates["w"].dtype), updates["w"].tolist()  # (1/4)/√4, in float32
    ('float32', [0.125, 0.125])
    >>> int(state.staleness), float(state.weight)
    (3, 0.125)
  """
  num_workers = _validation.concrete_int(num_workers)
  validate_weighting("scale_by_arrival_weight", num_workers, weighting)

  def init_fn(params):
    del params
    return ScaleByArrivalWeightState(
        staleness=jnp.zeros((), jnp.int32), weight=jnp.ones((), jnp.float32),
        rho=ArrivalWeighting(num_workers, weighting))

  def update_fn(updates, state, params=None, *, staleness=None, **extra_args):
    del params, extra_args
    updates, weight = apply_arrival_weight(
        updates, staleness, num_workers=num_workers, weighting=weighting)
    return updates, ScaleByArrivalWeightState(staleness_array(staleness), weight, state.rho)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def scale_by_age_gate(decay: float = 0.1, cutoff: float = 32.0
                      ) -> optax.GradientTransformationExtraArgs:
  """Multiplies pseudo-gradients by CGAD's age gate σ(τ) (``age_gate``), casting them to at
  least float32.

  Args:
    decay: α ≥ 0, the exponential decay per unit of staleness.
    cutoff: τ_c > 0, where the cosine gate reaches 0 (``math.inf``: no gate).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` takes ``staleness=``
    (None: 0); its state is a ``ScaleByArrivalWeightState`` (σ in ``weight``).

  References:
    Shah and Sun, Cosine-Gated Adam-Decay: Drop-In Staleness-Aware Outer Optimization for
    Decoupled DiLoCo, arXiv 2605.09126; ALGORITHMS.md, "CGAD".

  Examples:
    >>> import jax.numpy as jnp
    >>> import heloco_jax as hj
    >>> tx = hj.scale_by_age_gate(decay=0.0, cutoff=4.0)
    >>> grads = {"w": jnp.ones(2)}
    >>> updates, state = tx.update(grads, tx.init(grads), staleness=2)
    >>> [round(x, 6) for x in updates["w"].tolist()], int(state.staleness)  # ½(1 + cos(π/2))
    ([0.5, 0.5], 2)
  """
  validate_age_gate("scale_by_age_gate", decay, cutoff)
  gate = AgeGate(decay, cutoff)

  def init_fn(params):
    del params
    return ScaleByArrivalWeightState(staleness=jnp.zeros((), jnp.int32),
                                     weight=jnp.ones((), jnp.float32), rho=gate)

  def update_fn(updates, state, params=None, *, staleness=None, **extra_args):
    del params, extra_args
    weight = age_gate(staleness, decay=decay, cutoff=cutoff)
    updates = jax.tree.map(lambda d: weight * d, as_compute_dtype(updates))
    return updates, ScaleByArrivalWeightState(staleness_array(staleness), weight, state.rho)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
