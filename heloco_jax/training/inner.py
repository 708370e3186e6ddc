"""The compiled inner loop: H inner steps of one worker in one ``lax.scan``.

The loop runs any ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)``)
with any optax transform ``inner_tx``. Every step calls::

  updates, opt_state = inner_tx.update(grads, opt_state, params, step=step, ...)

with ``step`` the worker's *own* step count (``InnerState.step``), which
survives dispatches even when the optimizer state is reset at a dispatch
(``reset_optimizer``, the authors' "fresh AdamW state per dispatch"). Plain
optax transforms ignore it; ``scale_by_step_schedule`` reads its learning
rate from it, so that a schedule runs on over resets.

The default inner optimizer (``adamw``) is AdamW from optax pieces:
global-norm clipping, ``scale_by_adam``, decoupled weight decay on matrices
and a warm-up + cosine schedule indexed by the worker's step count.

PALSGD (docs/ALGORITHMS.md, "PALSGD") is the transform ``palsgd_inner``: with
an ``anchor`` θ̃ (the worker's stale copy of the global model) each step is,
with probability p, a pseudo-synchronization θ ← θ − (η_ps·α_t/p)·(θ − θ̃)
that leaves the optimizer state untouched, and otherwise an ordinary step
with learning rate α_t/(1 − p). The loop draws one uniform number per step
from the dispatch's PRNG key and passes it as ``uniform``.

Workers that start together are batched with ``run_many`` (``vmap`` over a
leading worker axis), as MaxText's DiLoCo stacks its replicas.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers
from typing import Any, Callable, Literal, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
import optax

from heloco_jax.training import sharding

Schedule = Union[float, Callable[[jax.Array], jax.Array]]


@dataclasses.dataclass(frozen=True)
class InnerConfig:
  """Settings of the default inner optimizer (``adamw``) and of PALSGD.

  Attributes:
    learning_rate: peak α of the schedule.
    warmup_steps: linear warm-up from 0 to α over the worker's first steps.
    total_steps: length of the cosine decay (in the worker's own steps);
      after it the rate stays at ``min_learning_rate_ratio``·α.
    min_learning_rate_ratio: final rate as a fraction of α, in [0, 1].
    weight_decay: AdamW decoupled weight decay, applied to matrices only.
    b1, b2, eps: Adam moments.
    grad_clip: global-norm clipping threshold; 0 turns it off.
    pseudo_sync_prob: PALSGD's p in [0, 1).
    pseudo_sync_rate: PALSGD's η_ps >= 0; η_ps·α/p must be <= 1.
  """
  learning_rate: float = 1e-3
  warmup_steps: int = 100
  total_steps: int = 10_000
  min_learning_rate_ratio: float = 0.1
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  grad_clip: float = 1.0
  pseudo_sync_prob: float = 0.2
  pseudo_sync_rate: float = 0.5

  def __post_init__(self):
    def fail(name, allowed):
      raise ValueError(f"inner.{name}={getattr(self, name)!r} is not allowed; allowed: {allowed}.")
    if not self.learning_rate > 0:
      fail("learning_rate", "a number > 0")
    if not (isinstance(self.warmup_steps, numbers.Integral) and self.warmup_steps >= 0):
      fail("warmup_steps", "an integer >= 0")
    if not (isinstance(self.total_steps, numbers.Integral)
            and self.total_steps > self.warmup_steps):
      fail("total_steps", f"an integer > warmup_steps={self.warmup_steps}")
    if not 0 <= self.min_learning_rate_ratio <= 1:
      fail("min_learning_rate_ratio", "a number in [0, 1]")
    if not self.weight_decay >= 0:
      fail("weight_decay", "a number >= 0")
    for name in ("b1", "b2"):
      if not 0 <= getattr(self, name) < 1:
        fail(name, "a number in [0, 1)")
    if not self.eps > 0:
      fail("eps", "a number > 0")
    if not self.grad_clip >= 0:
      fail("grad_clip", "a number >= 0 (0 = off)")
    if not 0 <= self.pseudo_sync_prob < 1:
      fail("pseudo_sync_prob", "a number in [0, 1)")
    if not self.pseudo_sync_rate >= 0:
      fail("pseudo_sync_rate", "a number >= 0")

  def check_pseudo_sync(self) -> None:
    """PALSGD's pull must be a convex combination: η_ps·α/p <= 1 (ALGORITHMS.md, PALSGD)."""
    check_pull(self.pseudo_sync_prob, self.pseudo_sync_rate, self.learning_rate,
               prefix="inner.")

  @property
  def schedule(self) -> optax.Schedule:
    """Warm-up from 0 to α, then cosine decay to ``min_learning_rate_ratio``·α."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=self.learning_rate, warmup_steps=self.warmup_steps,
        decay_steps=self.total_steps,
        end_value=self.learning_rate * self.min_learning_rate_ratio)


def check_pull(prob: float, rate: float, learning_rate: float, prefix: str = "") -> None:
  """Raises ValueError unless PALSGD's pull η_ps·α/p is at most 1."""
  if prob > 0 and rate * learning_rate / prob > 1:
    raise ValueError(
        f"{prefix}pseudo_sync_rate={rate!r} is not allowed with learning_rate="
        f"{learning_rate!r} and pseudo_sync_prob={prob!r}; allowed: "
        "pseudo_sync_rate·learning_rate/pseudo_sync_prob <= 1 (the pull must be a convex "
        "combination, ALGORITHMS.md PALSGD).")


def _as_schedule(learning_rate: Schedule) -> Callable[[jax.Array], jax.Array]:
  return learning_rate if callable(learning_rate) else (lambda step: jnp.asarray(learning_rate))


def scale_by_step_schedule(learning_rate: Schedule) -> optax.GradientTransformationExtraArgs:
  """Scales updates by −α_t·s, with α_t read at the worker's own step count.

  Args:
    learning_rate: a float or an optax schedule of the step count.

  Returns:
    A stateless transform whose ``update`` takes the keyword ``step`` (the
    worker's own step count, which the inner loop passes and which survives
    optimizer resets) and an optional ``lr_scale`` s (default 1).
  """
  schedule = _as_schedule(learning_rate)

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, step, lr_scale=1.0, **extra_args):
    del params, extra_args
    lr = schedule(step) * lr_scale
    return jax.tree.map(lambda u: -lr * u, updates), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _decay_mask(params: Any) -> Any:
  return jax.tree.map(lambda x: x.ndim >= 2, params)


def adamw_direction(config: InnerConfig) -> optax.GradientTransformation:
  """AdamW's direction without its learning rate: clipping, Adam, decay on matrices."""
  return optax.chain(
      optax.clip_by_global_norm(config.grad_clip) if config.grad_clip > 0 else optax.identity(),
      optax.scale_by_adam(b1=config.b1, b2=config.b2, eps=config.eps),
      optax.add_decayed_weights(config.weight_decay, mask=_decay_mask),
  )


def adamw(config: InnerConfig = InnerConfig()) -> optax.GradientTransformationExtraArgs:
  """The default inner optimizer: AdamW with the schedule at the worker's own step count.

  Args:
    config: learning rate, schedule, Adam and clipping settings.

  Returns:
    ``chain(adamw_direction(config), scale_by_step_schedule(config.schedule))``.
  """
  return optax.chain(adamw_direction(config), scale_by_step_schedule(config.schedule))


class PalsgdState(NamedTuple):
  """State of ``palsgd_inner``.

  Attributes:
    inner: the wrapped direction's state (e.g. Adam's moments).
    pseudo_sync: whether the last step was a pseudo-synchronization (bool).
  """
  inner: Any
  pseudo_sync: jax.Array


def palsgd_inner(direction: optax.GradientTransformation, learning_rate: Schedule, *,
                 pseudo_sync_prob: float = 0.2,
                 pseudo_sync_rate: float = 0.5) -> optax.GradientTransformationExtraArgs:
  """PALSGD's inner step as an optax transform (ALGORITHMS.md, "PALSGD").

  Args:
    direction: the inner optimizer without its learning rate (e.g.
      ``optax.scale_by_adam()``); its output is scaled by −α_t.
    learning_rate: α_t, a float or a schedule of the worker's step count.
    pseudo_sync_prob: p in [0, 1), the probability of a pseudo-sync step.
    pseudo_sync_rate: η_ps >= 0; the pull η_ps·α_t/p must be <= 1.

  Returns:
    A transform whose ``update(grads, state, params, *, step, anchor=None,
    uniform=None)`` takes the worker's step count, its stale global model θ̃
    (``anchor``) and a uniform number in [0, 1) for the step's coin. Without
    an anchor (e.g. PALSGD's DDP warm-up) it is the plain step with rate α_t.
    With one: if ``uniform < p``, updates = −(η_ps·α_t/p)·(θ − θ̃) and the state
    is unchanged; else the direction's update scaled by −α_t/(1 − p).

  References:
    Naganuma et al., "Pseudo-Asynchronous Local SGD", TMLR 2025
    (arXiv 2504.18454).
  """
  if not 0 <= pseudo_sync_prob < 1:
    raise ValueError(f"palsgd_inner: pseudo_sync_prob={pseudo_sync_prob!r} is not allowed; "
                     "allowed: a number in [0, 1).")
  if not pseudo_sync_rate >= 0:
    raise ValueError(f"palsgd_inner: pseudo_sync_rate={pseudo_sync_rate!r} is not allowed; "
                     "allowed: a number >= 0.")
  if not callable(learning_rate):
    check_pull(pseudo_sync_prob, pseudo_sync_rate, learning_rate)
  schedule = _as_schedule(learning_rate)
  direction = optax.with_extra_args_support(direction)
  p = pseudo_sync_prob

  def init_fn(params):
    return PalsgdState(direction.init(params), jnp.zeros((), bool))

  def update_fn(grads, state, params=None, *, step, anchor=None, uniform=None, **extra_args):
    del extra_args
    lr_scale = 1.0 if anchor is None else 1.0 / (1.0 - p)
    d, inner = direction.update(grads, state.inner, params)
    lr = schedule(step) * lr_scale
    step_updates = jax.tree.map(lambda u: -lr * u, d)
    if anchor is None:
      return step_updates, PalsgdState(inner, jnp.zeros((), bool))
    coin = uniform < p
    pull = pseudo_sync_rate * schedule(step) / p if p > 0 else 0.0
    pulled = jax.tree.map(lambda x, a: -(pull * (x - a)), params, anchor)

    def pick(new, old):
      return jnp.where(coin, new, old)
    updates = jax.tree.map(pick, pulled, step_updates)
    return updates, PalsgdState(jax.tree.map(pick, state.inner, inner), coin)

  tx = PalsgdTransform(init_fn, update_fn)
  tx.pseudo_sync_prob = p  # the engine draws a round's coins ahead (``pseudo_sync_steps``)
  return tx


class PalsgdTransform(optax.GradientTransformationExtraArgs):
  """``palsgd_inner``'s transform: an optax one that also knows its ``pseudo_sync_prob``."""


def pseudo_sync_steps(tx: Any, keys: jax.Array, steps: int) -> Optional[np.ndarray]:
  """Per key of ``keys`` (a round's, one per worker), how many of ``steps`` steps of
  ``run`` with ``tx`` are PALSGD pseudo-sync steps: the coins ``run`` draws, drawn ahead, so
  that a round is checked against its budget before it is computed; None when ``tx`` does
  not say its probability (not ``palsgd_inner``'s)."""
  p = getattr(tx, "pseudo_sync_prob", None)
  if p is None:
    return None
  return np.asarray(jnp.sum(_coins(keys, steps, True) < p, axis=1))


class InnerState(NamedTuple):
  """One worker's inner state: θ, the inner optimizer's state and its own step count.

  With a ``loss_fn`` that takes them (``LossContract``), also the worker's model state (what
  ``loss_fn`` returns as its new state: BatchNorm statistics, …) and its PRNG key data, from
  which step s's key is ``fold_in(key, s)`` (docs/DESIGN.md, "Model state and randomness").
  Both are None otherwise, so that a plain ``loss_fn``'s state holds θ's leaves as before.
  """
  params: Any
  opt_state: Any
  step: jax.Array
  model_state: Any = None
  rng: Any = None


def seed_state(model_state: Any, rng: Any) -> InnerState:
  """What a worker's first dispatch starts from besides θ: the model state it receives and
  its PRNG key data (``InnerLoop.start`` reads these two from a state with ``step`` None)."""
  return InnerState(None, None, None, model_state, rng)


@dataclasses.dataclass(frozen=True)
class LossContract:
  """What a ``loss_fn`` takes besides ``(params, batch)``, read from its signature.

  Attributes:
    state: it takes the keyword ``state`` (the model state besides θ) and returns
      ``(loss, (new_state, metrics))``.
    rng: it takes the keyword ``rng``: a fresh PRNG key every inner step.
  """
  state: bool = False
  rng: bool = False

  @classmethod
  def of(cls, loss_fn: Callable[..., Any]) -> "LossContract":
    try:
      names = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):  # a builtin or a C function: the plain contract
      return cls()
    return cls(state="state" in names, rng="rng" in names)

  def call(self, loss_fn: Callable[..., Any], params: Any, batch: Any, model_state: Any,
           rng: Any) -> Any:
    """``loss_fn`` called with what it takes."""
    kwargs = {}
    if self.state:
      kwargs["state"] = model_state
    if self.rng:
      kwargs["rng"] = rng
    return loss_fn(params, batch, **kwargs)


def metric_leaves(metrics: dict) -> dict[str, Any]:
  """A metrics dict's leaves by name, a nested dict's as ``outer/inner`` (TensorBoard's
  groups; docs/DESIGN.md, "Model state and randomness")."""
  def name(path: Any) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                    for k in path)
  return {name(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(metrics)}


def scalar_metrics(metrics: Any) -> dict[str, jax.Array]:
  """The scalar numbers and booleans of a ``loss_fn``'s metrics dict, nested dicts' by
  ``outer/inner`` (anything else is not a metric); a boolean's mean is the fraction of
  steps it held."""
  if not isinstance(metrics, dict):
    return {}
  return {k: jnp.asarray(v, jnp.float32) for k, v in sorted(metric_leaves(metrics).items())
          if is_metric(v)}


def is_metric(value: Any) -> bool:
  """A scalar number or boolean: an array, a tracer, a ``jax.ShapeDtypeStruct`` or a Python
  number."""
  if hasattr(value, "dtype"):
    dtype = value.dtype
  elif isinstance(value, numbers.Number):
    dtype = jnp.result_type(value)
  else:
    return False
  return (tuple(getattr(value, "shape", ())) == ()
          and (jnp.issubdtype(dtype, jnp.number) or dtype == jnp.bool_))


class InnerMetrics(NamedTuple):
  """Per-step outputs of ``run``, each of shape (H,).

  Attributes:
    loss: training loss of the step (0 on pseudo-sync steps).
    pseudo_sync: True where the step was a PALSGD pseudo-sync step.
    step: the worker's step count at the start of the step.
    user: the scalar metrics ``loss_fn`` returned (``scalar_metrics``), by name.
  """
  loss: jax.Array
  pseudo_sync: jax.Array
  step: jax.Array
  user: Any = None


@jax.jit
def train_loss(metrics: InnerMetrics) -> Any:
  """The mean training loss over the steps of ``metrics`` (any shape) that read a batch
  (PALSGD's pseudo-sync steps have none); with metrics from ``loss_fn``, a dict
  ``{"train_loss": …, "train_<name>": …}`` of their means over the same steps."""
  real = ~metrics.pseudo_sync
  count = jnp.maximum(jnp.sum(real), 1)
  def mean(x):
    return jnp.sum(jnp.where(real, x, 0.0)) / count
  if not metrics.user:
    return mean(metrics.loss)
  return {"train_loss": mean(metrics.loss),
          **{f"train_{name}": mean(x) for name, x in metrics.user.items()}}


# Optimizer states whose ``count`` is a schedule's step, not a statistic's: a reset keeps it.
_SCHEDULE_STATES = (optax.ScaleByScheduleState, optax.InjectHyperparamsState,
                    optax.InjectStatefulHyperparamsState)


def _is_schedule_state(node: Any) -> bool:
  return isinstance(node, _SCHEDULE_STATES)


def schedule_counts(opt_state: Any) -> Any:
  """What ``keep_schedule_counts`` reads of an optimizer state: its schedule states (their
  inner states pruned alike), None in place of every other leaf (Adam's moments, …)."""
  def prune(node):
    if not _is_schedule_state(node):
      return None
    if hasattr(node, "inner_state"):
      node = node._replace(inner_state=schedule_counts(node.inner_state))
    return node
  return jax.tree.map(prune, opt_state, is_leaf=_is_schedule_state)


def only_schedule_counts(opt_state: Any) -> bool:
  """Whether an optimizer state holds nothing but schedule counts (a ``schedule_counts``, or a
  rule without statistics): a fresh state with its counts is then the same state."""
  return len(jax.tree.leaves(opt_state)) == len(jax.tree.leaves(schedule_counts(opt_state)))


def keep_schedule_counts(fresh: Any, old: Any) -> Any:
  """``fresh`` (a new ``inner_tx`` state) with the schedule step counts of ``old``.

  A reset restarts the optimizer's statistics (Adam's moments and their bias
  correction), not its learning-rate schedules: ``optax.adam(schedule)``'s
  ``ScaleByScheduleState.count`` and ``optax.inject_hyperparams``' count
  carry over, so that a warm-up is not redone at every dispatch (README,
  "Inner optimizer state").
  """
  def keep(new, previous):
    if not _is_schedule_state(new):
      return new
    if hasattr(new, "inner_state"):  # inject_hyperparams: schedules may sit inside too
      new = new._replace(inner_state=keep_schedule_counts(new.inner_state,
                                                          previous.inner_state))
    return new._replace(count=previous.count)
  return jax.tree.map(keep, fresh, old, is_leaf=_is_schedule_state)


class InnerLoop:
  """H inner steps of ``loss_fn`` with ``inner_tx`` as one compiled call.

  Args:
    loss_fn: ``(params, batch) -> loss`` or ``(loss, aux)``.
    inner_tx: any optax transform (default: ``adamw()``).
    reset_optimizer: start every dispatch with a fresh ``inner_tx`` state.
      The worker's step count and every schedule's step count in the state
      (``keep_schedule_counts``) are kept either way.
    layout: θ's ``heloco_jax.training.sharding.Layout`` when θ is sharded: the states
      the loop makes keep it (None: wherever XLA puts them).
    spmd_axis_name: the mesh axis stacked workers (``run_many``) are split
      over (``jax.vmap``'s ``spmd_axis_name``); None: not split.
    loop: how the H steps of a dispatch run: "scan" (one ``lax.scan``, one program),
      "steps" (one compiled step per Python iteration) or "auto" (``auto_loop``: "steps"
      for a ``loss_fn`` with a convolution on CPU, else "scan"; docs/DESIGN.md, "The inner
      loop"). The two give the same math, not the same float bits.
  """

  def __init__(self, loss_fn: Callable[..., Any],
               inner_tx: Optional[optax.GradientTransformation] = None,
               reset_optimizer: bool = True, layout: Optional[sharding.Layout] = None,
               spmd_axis_name: Optional[str] = None, loop: Loop = "auto"):
    self.loss_fn = loss_fn
    self.contract = LossContract.of(loss_fn)
    self.tx = optax.with_extra_args_support(adamw() if inner_tx is None else inner_tx)
    self.reset_optimizer = reset_optimizer
    self.layout = layout
    self._constrain = layout.constrain if layout is not None else lambda tree: tree
    self._vmap = functools.partial(jax.vmap, spmd_axis_name=spmd_axis_name)
    check_loop(loop)
    self.loop = loop
    self.spmd_axis_name = spmd_axis_name
    self._resolved: Optional[str] = None if loop == "auto" else loop
    self.run_scan = jax.jit(self.run, donate_argnums=0)
    self.start_jit = jax.jit(self.start)  # one program instead of eager per-leaf copies and zeros
    self.run_many_scan = jax.jit(self._vmap(self.run, in_axes=(0, 0, 0, None))
                                 if spmd_axis_name is None
                                 else self._run_per_slice(spmd_axis_name), donate_argnums=0)
    self._flat_steps: dict[Any, Callable[..., Any]] = {}  # "steps" (``run_steps``)
    self.start_many = jax.jit(self._start_many, static_argnums=2)
    self.reset_moments = jax.jit(self._reset_moments)
    # ``carry`` compiled: the kept leaves alias the donated state's, nothing is copied.
    self.carry_jit = jax.jit(self.carry, donate_argnums=0)

  def start(self, params: Any, previous: Optional[InnerState] = None) -> InnerState:
    """The state for a dispatch from ``params``.

    Keeps ``previous``'s step count, and its optimizer state unless
    ``reset_optimizer``; a first dispatch starts at step 0. ``params`` is
    copied: ``run_jit`` donates the state, and the caller's θ must survive.
    """
    params = jax.tree.map(jnp.array, params)  # jnp.array copies
    if previous is None or previous.step is None:  # a first dispatch (``seed_state``)
      carried = (None, None) if previous is None else (previous.model_state, previous.rng)
      carried = jax.tree.map(jnp.array, carried)
      return self._constrain(InnerState(params, self.tx.init(params), jnp.zeros((), jnp.int32),
                                        *carried))
    fresh = self.reset_optimizer or only_schedule_counts(previous.opt_state)
    opt_state = (keep_schedule_counts(self.tx.init(params), previous.opt_state)
                 if fresh else previous.opt_state)
    return self._constrain(InnerState(params, opt_state, previous.step,
                                      *jax.tree.map(jnp.array,
                                                    (previous.model_state, previous.rng))))

  def with_layout(self, layout: Optional[sharding.Layout],
                  spmd_axis_name: Optional[str] = None) -> "InnerLoop":
    """The same loop compiled for ``layout`` (a worker group's or a round's mesh)."""
    return InnerLoop(self.loss_fn, self.tx, self.reset_optimizer, layout, spmd_axis_name,
                     self.loop)

  def with_loop(self, loop: "Loop") -> "InnerLoop":
    """The same loop run as ``loop`` ("auto", "scan" or "steps")."""
    if loop == self.loop:
      return self
    return InnerLoop(self.loss_fn, self.tx, self.reset_optimizer, self.layout,
                     self.spmd_axis_name, loop)

  def _run_per_slice(self, axis: str) -> Callable[..., tuple[InnerState, InnerMetrics]]:
    """``run`` for K stacked workers split over the mesh axis ``axis``, one worker per slice:
    each slice runs one worker's program (``jax.shard_map`` over ``axis``; θ's axes stay with
    XLA). Not ``jax.vmap``: a vmapped convolution whose kernel is split over ``axis`` and over
    its output features is miscompiled by XLA's Shardy partitioner (jax 0.10–0.12: wrong
    values, tests/training/test_sharding.py)."""
    assert self.layout is not None

    def run_one(states, batches, keys, anchor):
      # θ's specs on the mesh as seen inside (``axis`` manual)
      inner = self.with_layout(self.layout.on(jax.sharding.get_abstract_mesh()))
      take = functools.partial(jax.tree.map, lambda x: x[0])
      out = inner.run(take(states), take(batches), take(keys), anchor)
      return jax.tree.map(lambda x: x[None], out)

    split = P(axis)
    return jax.shard_map(run_one, mesh=self.layout.mesh, in_specs=(split, split, split, P()),
                         out_specs=split, axis_names={axis})

  def carry(self, state: InnerState) -> InnerState:
    """What the next dispatch, which starts from θ, reads of a worker's end ``state``
    (docs/DESIGN.md, "Memory per worker"): its step count, optimizer state, model state and
    key, no θ; with ``reset_optimizer`` only the optimizer state's schedule counts
    (``schedule_counts``): ``start`` makes the moments afresh. The same numbers either way."""
    if state.params is None:
      return state
    opt_state = schedule_counts(state.opt_state) if self.reset_optimizer else state.opt_state
    return state._replace(params=None, opt_state=opt_state)

  def fresh_moments(self, state: InnerState) -> InnerState:
    """``state`` with a fresh optimizer state (its step counts kept): after a rejected Δ. A
    ``carry`` keeps only its schedule counts: its next ``start`` makes the moments."""
    if state.params is None:
      return state._replace(opt_state=schedule_counts(state.opt_state))
    return state._replace(
        opt_state=keep_schedule_counts(self.tx.init(state.params), state.opt_state))

  def _start_many(self, params: Any, previous: Optional[InnerState],
                  num_workers: int) -> InnerState:
    """``start`` for K workers at once (a round), stacked on a leading axis.

    One compiled program, so that processes of a ``jax.distributed`` run
    execute the same collective program instead of many small eager ones.
    """
    if previous is None:
      return self._constrain(jax.tree.map(lambda x: jnp.stack([x] * num_workers),
                                          self.start(params)))
    return self._constrain(self._vmap(self.start, in_axes=(None, 0))(params, previous))

  def _reset_moments(self, states: InnerState, rejected: jax.Array) -> InnerState:
    """K stacked states with fresh optimizer states where ``rejected`` (bool, K); steps kept."""
    fresh = keep_schedule_counts(self._vmap(self.tx.init)(states.params), states.opt_state)
    def pick(new, old):
      return jnp.where(rejected.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)
    return self._constrain(states._replace(opt_state=jax.tree.map(pick, fresh, states.opt_state)))

  def _value_and_grad(self, state: InnerState, batch: Any
                      ) -> tuple[jax.Array, Any, Any, dict[str, jax.Array]]:
    """(loss, grads, new model state, scalar metrics) of ``loss_fn`` at ``state``
    (docs/DESIGN.md, "Model state and randomness"): a plain ``loss_fn``'s ``(loss, aux)``
    gives the scalars of a dict ``aux`` as metrics; one that takes ``state`` returns
    ``(loss, (new_state, metrics))``."""
    contract = self.contract
    loss_fn = functools.partial(self._call, state, batch)
    out = jax.eval_shape(loss_fn, state.params)
    if isinstance(out, tuple):
      (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    else:
      (loss, grads), aux = jax.value_and_grad(loss_fn)(state.params), None
    if contract.state:
      new_state, metrics = aux
      return loss, grads, new_state, scalar_metrics(metrics)
    return loss, grads, state.model_state, scalar_metrics(aux)

  def _call(self, state: InnerState, batch: Any, params: Any) -> Any:
    """``loss_fn`` at ``params`` on ``batch``, with ``state``'s model state and this step's
    key where it takes them."""
    rng = (jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
           if self.contract.rng else None)
    return self.contract.call(self.loss_fn, params, batch, state.model_state, rng)

  def _loss_only(self, state: InnerState, batch: Any, params: Any, step: Any = None
                 ) -> jax.Array:
    """``loss_fn``'s loss at ``params`` on ``batch`` (``step``'s ``value_fn``; optax's
    line search passes it the step's other extra arguments by name: ``step``, unused)."""
    del step
    out = self._call(state, batch, params)
    return out[0] if isinstance(out, tuple) else out

  def step(self, state: InnerState, batch: Any, **extra_args: Any
           ) -> tuple[InnerState, jax.Array, dict[str, jax.Array]]:
    """One inner step; ``extra_args`` go to ``inner_tx.update``. Returns (state, loss,
    ``loss_fn``'s scalar metrics)."""
    loss, grads, model_state, metrics = self._value_and_grad(state, batch)
    # optax's extra arguments of a step (reduce_on_plateau's value; L-BFGS's value, grad
    # and value_fn, the loss on this batch): a transform that takes none ignores them.
    updates, opt_state = self.tx.update(grads, state.opt_state, state.params, step=state.step,
                                        value=loss, grad=grads,
                                        value_fn=functools.partial(self._loss_only, state,
                                                                   batch), **extra_args)
    return InnerState(optax.apply_updates(state.params, updates), opt_state, state.step + 1,
                      model_state, state.rng), loss, metrics

  def run(self, state: InnerState, batches: Any, key: jax.Array,
          anchor: Any = None) -> tuple[InnerState, InnerMetrics]:
    """H inner steps in one ``lax.scan``, H the leading size of ``batches``' leaves.

    Args:
      state: the worker's ``InnerState`` (from ``start``).
      batches: a pytree of arrays with a leading axis of H, one batch per step.
      key: PRNG key of the dispatch (PALSGD's coins; unused without an anchor).
      anchor: PALSGD's θ̃, passed to ``inner_tx`` with a uniform number per
        step; None for a plain inner loop.

    Returns:
      The state after H steps, and ``InnerMetrics`` of shape (H,).
    """
    steps = jax.tree.leaves(batches)[0].shape[0]
    uniform = (jnp.zeros((steps,)) if anchor is None
               else jax.random.uniform(key, (steps,)))  # one coin per step

    def body(state, inputs):
      batch, u = inputs
      return self._one_step(state, batch, u, anchor)

    return jax.lax.scan(body, state, (batches, uniform))

  def _one_step(self, state: InnerState, batch: Any, u: jax.Array, anchor: Any
                ) -> tuple[InnerState, InnerMetrics]:
    """One step of ``run``: ``u`` is the step's coin (PALSGD, with an ``anchor``)."""
    extra = {} if anchor is None else {"anchor": anchor, "uniform": u}
    new, loss, user = self.step(state, batch, **extra)
    new = self._constrain(new)
    pseudo = getattr(new.opt_state, "pseudo_sync", jnp.zeros((), bool))
    if anchor is not None:  # PALSGD: a pseudo-sync step reads no batch; its model state
      new = new._replace(model_state=jax.tree.map(  # stays as it was
          lambda a, b: jnp.where(pseudo, a, b), state.model_state, new.model_state))
    return new, InnerMetrics(jnp.where(pseudo, 0.0, loss), pseudo, state.step, user)

  def _pull_step(self, state: InnerState, batch: Any, u: jax.Array, anchor: Any
                 ) -> tuple[InnerState, InnerMetrics]:
    """``_one_step`` where ``u`` is known to be a PALSGD pseudo-sync coin: the same pull and
    state, without evaluating the loss and its gradient, which that step drops."""
    _, _, _, user = jax.eval_shape(self._value_and_grad, state, batch)  # metrics' names
    zeros = jax.tree.map(jnp.zeros_like, state.params)
    updates, opt_state = self.tx.update(zeros, state.opt_state, state.params, step=state.step,
                                        anchor=anchor, uniform=u)
    new = self._constrain(InnerState(optax.apply_updates(state.params, updates), opt_state,
                                     state.step + 1, state.model_state, state.rng))
    return new, InnerMetrics(jnp.zeros(()), opt_state.pseudo_sync, state.step,
                             jax.tree.map(lambda m: jnp.zeros(m.shape, m.dtype), user))

  def loop_for(self, state: InnerState, batch: Callable[[], Any]) -> str:
    """The loop this InnerLoop runs ("scan" or "steps"), decided at its first dispatch from
    one worker's ``state`` and one step's ``batch()`` (``auto_loop``)."""
    if self._resolved is None:
      if self.layout is not None or self.spmd_axis_name is not None:
        self._resolved = "scan"  # a sharded θ keeps one program (docs/DESIGN.md)
      elif _platform(state) != "cpu":
        self._resolved = auto_loop(_platform(state), True)
      else:  # the loss's forward pass holds its convolutions (traced once, not run)
        abstract = _abstract(state)
        self._resolved = auto_loop("cpu", _has_convolution(jax.make_jaxpr(self._call)(
            abstract, _abstract(batch()), abstract.params)))
    return self._resolved

  def run_jit(self, state: InnerState, batches: Any, key: jax.Array, anchor: Any = None
              ) -> tuple[InnerState, InnerMetrics]:
    """``run`` compiled (``state`` donated), as ``loop_for`` says: one scan or H steps."""
    if self.loop_for(state, lambda: jax.tree.map(lambda x: x[0], batches)) == "scan":
      self.run_jit = self.run_scan  # decided: the next dispatches call the program itself
      return self.run_scan(state, batches, key, anchor)
    return self.run_steps(state, batches, key, anchor)

  def run_many(self, states: InnerState, batches: Any, keys: jax.Array, anchor: Any = None
               ) -> tuple[InnerState, InnerMetrics]:
    """``run`` for K workers stacked on a leading axis (``vmap``), as ``loop_for`` says."""
    one = jax.tree.map(lambda x: x[0], states) if self._resolved is None else states
    if self.loop_for(one, lambda: jax.tree.map(lambda x: x[0, 0], batches)) == "scan":
      return self.run_many_scan(states, batches, keys, anchor)
    return self.run_steps(states, batches, keys, anchor, many=True)

  def run_steps(self, state: InnerState, batches: Any, key: jax.Array, anchor: Any = None,
                many: bool = False) -> tuple[InnerState, InnerMetrics]:
    """``run`` as H compiled steps from Python (``many``: K stacked workers, vmapped): the
    scan's body, its coins drawn alike; the metrics stacked on the step axis."""
    axis = 1 if many else 0
    steps = jax.tree.leaves(batches)[0].shape[axis]
    if steps == 0:  # nothing to stack: the scan's empty metrics
      return (self.run_many_scan if many else self.run_scan)(state, batches, key, anchor)
    shape = (len(key), steps) if many else (steps,)
    uniform = (np.zeros(shape, np.float32) if anchor is None  # on the host: no op per step
               else np.asarray(_coins(key, steps, many)))
    p = None if anchor is None else getattr(self.tx, "pseudo_sync_prob", None)
    # The state crosses each call as its leaves: flattening flax's State trees costs more
    # than a small step's dispatch (docs/BENCHMARKS.md, "A user's model").
    leaves, treedef = jax.tree.flatten(state)
    anchor_leaves, anchor_def = jax.tree.flatten(anchor)
    metrics = []
    for i in range(steps):
      batch = jax.tree.map(lambda x, i=i: x[:, i] if many else x[i], batches)
      u = uniform[:, i] if many else uniform[i]
      # PALSGD: a step whose coins all say pseudo-sync is the pull alone (``_pull_step``)
      pull = p is not None and bool(np.all(u < np.float32(p)))
      leaves, m = self._flat_step(pull, many, treedef, anchor_def)(leaves, batch, u,
                                                                  anchor_leaves)
      metrics.append(m)
    return jax.tree.unflatten(treedef, leaves), _stack_steps(metrics, axis)

  def _flat_step(self, pull: bool, many: bool, treedef: Any, anchor_def: Any
                 ) -> Callable[..., Any]:
    """``_one_step`` (``pull``: ``_pull_step``) compiled on the state's leaves (donated)
    and the anchor's (``many``: vmapped over stacked workers)."""
    key = (pull, many, treedef, anchor_def)
    if key not in self._flat_steps:
      body = self._pull_step if pull else self._one_step

      def flat(leaves, batch, u, anchor_leaves):
        new, m = body(jax.tree.unflatten(treedef, leaves), batch, u,
                      jax.tree.unflatten(anchor_def, anchor_leaves))
        new_leaves, new_def = jax.tree.flatten(new)
        assert new_def == treedef, (new_def, treedef)  # a step keeps the state's structure
        return new_leaves, m
      self._flat_steps[key] = jax.jit(jax.vmap(flat, in_axes=(0, 0, 0, None)) if many
                                      else flat, donate_argnums=0)
    return self._flat_steps[key]


@functools.partial(jax.jit, static_argnums=(1, 2))
def _coins(key: jax.Array, steps: int, many: bool) -> jax.Array:
  """PALSGD's uniform numbers of ``run``, one per step (``many``: per key of a stack)."""
  draw = functools.partial(jax.random.uniform, shape=(steps,))
  return jax.vmap(draw)(key) if many else draw(key)


@functools.partial(jax.jit, static_argnums=1)
def _stack_steps(metrics: list, axis: int) -> Any:
  """Per-step metrics stacked on ``axis`` (one compiled program)."""
  return jax.tree.map(lambda *xs: jnp.stack(xs, axis=axis), *metrics)


Loop = Literal["auto", "scan", "steps"]


def check_loop(loop: Any, name: str = "loop") -> None:
  if loop not in ("auto", "scan", "steps"):
    raise ValueError(f"{name}={loop!r} is not allowed; allowed: 'auto', 'scan' or 'steps'")


def auto_loop(platform: str, convolution: bool) -> str:
  """"steps" for a step with a convolution on CPU, else "scan": XLA:CPU runs a convolution
  inside a while loop several times slower than alone (``python -m benchmarks.users_model``,
  docs/DESIGN.md, "The inner loop"); a scan keeps the bits of earlier releases elsewhere."""
  return "steps" if platform == "cpu" and convolution else "scan"


def _platform(tree: Any) -> str:
  """The platform of ``tree``'s first placed array (else JAX's default backend)."""
  for leaf in jax.tree.leaves(tree):
    sharding_ = getattr(leaf, "sharding", None)
    if sharding_ is not None:
      return next(iter(sharding_.device_set)).platform
  return jax.default_backend()


def _abstract(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _has_convolution(jaxpr: Any) -> bool:
  """Whether a (closed) jaxpr, or one inside it, has a convolution."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "conv_general_dilated":
      return True
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
          if _has_convolution(sub):
            return True
  return False
