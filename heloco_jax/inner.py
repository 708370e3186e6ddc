"""The compiled inner loop: H inner steps of one worker in one ``lax.scan``.

Inner optimizer: AdamW from optax pieces (``scale_by_adam`` + decoupled weight
decay on matrices, optional global-norm clipping) with a warm-up + cosine
learning-rate schedule indexed by the worker's *own* step count, which lives
in ``InnerState.step`` and survives dispatches even when the AdamW moments
are reset (``InnerConfig.reset_optimizer``, default True).

PALSGD (ALGORITHMS.md, "PALSGD"): with an ``anchor`` θ̃ (the worker's stale
copy of the global model), every step flips a coin. With probability p it is
a pseudo-synchronization step, θ ← θ − (η_ps·α_t/p)·(θ − θ̃), with no forward
or backward pass and its batch left unused; otherwise an ordinary AdamW step
with learning rate α_t/(1 − p). The choice is a ``lax.cond`` inside the
same scan (under ``vmap`` both branches run and one is selected). Both kinds
advance the step count.

Workers that start together are batched with ``run_many`` (``vmap`` over a
leading worker axis), as MaxText's DiLoCo stacks its replicas.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from heloco_jax import model as model_lib


@dataclasses.dataclass(frozen=True)
class InnerConfig:
  """Inner optimizer and PALSGD settings.

  Attributes:
    learning_rate: peak α of the schedule.
    warmup_steps: linear warm-up from 0 to α over the worker's first steps.
    total_steps: length of the cosine decay (in the worker's own steps);
      after it the rate stays at ``min_learning_rate_ratio``·α.
    min_learning_rate_ratio: final rate as a fraction of α, in [0, 1].
    weight_decay: AdamW decoupled weight decay, applied to matrices only.
    b1, b2, eps: Adam moments.
    grad_clip: global-norm clipping threshold; 0 turns it off.
    reset_optimizer: reset the AdamW moments at every dispatch (default);
      the step count, and so the schedule, is never reset.
    pseudo_sync_prob: PALSGD's p in [0, 1); only read when an anchor is given.
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
  reset_optimizer: bool = True
  pseudo_sync_prob: float = 0.2
  pseudo_sync_rate: float = 0.5

  def __post_init__(self):
    def fail(name, allowed):
      raise ValueError(f"inner.{name}={getattr(self, name)!r} is not allowed; allowed: {allowed}.")
    if not self.learning_rate > 0:
      fail("learning_rate", "a number > 0")
    if not (isinstance(self.warmup_steps, int) and self.warmup_steps >= 0):
      fail("warmup_steps", "an integer >= 0")
    if not (isinstance(self.total_steps, int) and self.total_steps > self.warmup_steps):
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
    if (self.pseudo_sync_prob > 0
        and self.pseudo_sync_rate * self.learning_rate / self.pseudo_sync_prob > 1):
      raise ValueError(
          f"inner.pseudo_sync_rate={self.pseudo_sync_rate!r} is not allowed with "
          f"learning_rate={self.learning_rate!r} and pseudo_sync_prob={self.pseudo_sync_prob!r}; "
          "allowed: pseudo_sync_rate·learning_rate/pseudo_sync_prob <= 1 (the pull must be a "
          "convex combination, ALGORITHMS.md PALSGD).")


def config_from(inner: Any, reset_optimizer: bool = True) -> InnerConfig:
  """The ``InnerConfig`` of a run config's ``inner`` section (configs/default.py)."""
  return InnerConfig(
      learning_rate=inner.learning_rate, warmup_steps=inner.warmup_steps,
      total_steps=inner.total_steps, min_learning_rate_ratio=inner.min_learning_rate_ratio,
      weight_decay=inner.weight_decay, grad_clip=inner.grad_clip,
      reset_optimizer=reset_optimizer, pseudo_sync_prob=inner.pseudo_sync_prob,
      pseudo_sync_rate=inner.pseudo_sync_rate)


class InnerState(NamedTuple):
  """One worker's inner state: θ, AdamW state and its own step count."""
  params: Any
  opt_state: Any
  step: jax.Array


class InnerMetrics(NamedTuple):
  """Per-step outputs of ``run``, each of shape (H,).

  Attributes:
    loss: training loss of the step (0 on pseudo-sync steps).
    pseudo_sync: True where the step was a PALSGD pseudo-sync step.
    learning_rate: α_t of the step (before PALSGD's 1/(1 − p) rescale).
  """
  loss: jax.Array
  pseudo_sync: jax.Array
  learning_rate: jax.Array


def _decay_mask(params: Any) -> Any:
  return jax.tree.map(lambda x: x.ndim >= 2, params)


class InnerLoop:
  """H inner steps of the model ``graphdef`` as one compiled call.

  Args:
    graphdef: the model's ``nnx.GraphDef`` (see ``heloco_jax.model.init``).
    config: the ``InnerConfig``.
  """

  def __init__(self, graphdef: nnx.GraphDef, config: InnerConfig = InnerConfig()):
    self.graphdef = graphdef
    self.config = config
    self.schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.learning_rate, warmup_steps=config.warmup_steps,
        decay_steps=config.total_steps,
        end_value=config.learning_rate * config.min_learning_rate_ratio)
    # AdamW's direction (optax.adamw without its learning rate, which comes
    # from the worker's own step count instead of the optimizer's count).
    self.direction = optax.chain(
        optax.clip_by_global_norm(config.grad_clip) if config.grad_clip > 0 else optax.identity(),
        optax.scale_by_adam(b1=config.b1, b2=config.b2, eps=config.eps),
        optax.add_decayed_weights(config.weight_decay, mask=_decay_mask),
    )
    self.run_jit = jax.jit(self.run, donate_argnums=0)
    self.run_many = jax.jit(jax.vmap(self.run, in_axes=(0, 0, 0, None)), donate_argnums=0)
    self.start_many = jax.jit(self._start_many, static_argnums=2)
    self.reset_moments = jax.jit(self._reset_moments)

  def start(self, params: Any, previous: Optional[InnerState] = None) -> InnerState:
    """The state for a dispatch from ``params``.

    Keeps ``previous``'s step count, and its AdamW moments unless
    ``reset_optimizer``; a first dispatch starts at step 0. ``params`` is
    copied: ``run_jit`` donates the state, and the caller's θ must survive.
    """
    params = jax.tree.map(jnp.array, params)  # jnp.array copies
    if previous is None:
      return InnerState(params, self.direction.init(params), jnp.zeros((), jnp.int32))
    opt_state = (self.direction.init(params) if self.config.reset_optimizer
                 else previous.opt_state)
    return InnerState(params, opt_state, previous.step)

  def _start_many(self, params: Any, previous: Optional[InnerState],
                  num_workers: int) -> InnerState:
    """``start`` for K workers at once (a round), stacked on a leading axis.

    One compiled program, so that processes of a ``jax.distributed`` run
    execute the same collective program instead of many small eager ones.
    """
    if previous is None:
      return jax.tree.map(lambda x: jnp.stack([x] * num_workers), self.start(params))
    return jax.vmap(self.start, in_axes=(None, 0))(params, previous)

  def _reset_moments(self, states: InnerState, rejected: jax.Array) -> InnerState:
    """K stacked states with fresh AdamW moments where ``rejected`` (bool, K); steps kept."""
    fresh = jax.vmap(self.direction.init)(states.params)
    def pick(new, old):
      return jnp.where(rejected.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)
    return states._replace(opt_state=jax.tree.map(pick, fresh, states.opt_state))

  def adamw_step(self, state: InnerState, batch: jax.Array,
                 lr_scale: Any = 1.0) -> tuple[InnerState, jax.Array]:
    """One ordinary AdamW step with learning rate α_t·lr_scale; returns (state, loss)."""
    loss, grads = jax.value_and_grad(model_lib.loss, argnums=1)(self.graphdef, state.params, batch)
    direction, opt_state = self.direction.update(grads, state.opt_state, state.params)
    lr = self.schedule(state.step) * lr_scale
    params = jax.tree.map(lambda p, d: (p - lr * d).astype(p.dtype), state.params, direction)
    return InnerState(params, opt_state, state.step + 1), loss

  def pseudo_sync_step(self, state: InnerState, anchor: Any) -> InnerState:
    """PALSGD pseudo-sync: θ ← θ − (η_ps·α_t/p)·(θ − θ̃); no gradient, AdamW state untouched."""
    pull = (self.config.pseudo_sync_rate * self.schedule(state.step)
            / self.config.pseudo_sync_prob)
    params = jax.tree.map(lambda p, a: (p - pull * (p - a)).astype(p.dtype), state.params, anchor)
    return InnerState(params, state.opt_state, state.step + 1)

  def run(self, state: InnerState, batches: jax.Array, key: jax.Array,
          anchor: Any = None) -> tuple[InnerState, InnerMetrics]:
    """H = len(batches) inner steps in one ``lax.scan``.

    Args:
      state: the worker's ``InnerState`` (from ``start``).
      batches: int tokens (H, batch, context + 1), one batch per step.
      key: PRNG key for PALSGD's coins (unused without an anchor).
      anchor: PALSGD's θ̃; None for a plain inner loop.

    Returns:
      The state after H steps, and ``InnerMetrics`` of shape (H,).
    """
    p = self.config.pseudo_sync_prob
    coins = jax.random.uniform(key, (batches.shape[0],)) < p

    def body(state, inputs):
      batch, coin = inputs
      alpha = self.schedule(state.step)
      if anchor is None:
        state, loss = self.adamw_step(state, batch)
        return state, InnerMetrics(loss, jnp.zeros((), bool), alpha)
      state, loss = jax.lax.cond(
          coin,
          lambda s: (self.pseudo_sync_step(s, anchor), jnp.zeros((), jnp.float32)),
          lambda s: self.adamw_step(s, batch, 1.0 / (1.0 - p)),
          state)
      return state, InnerMetrics(loss, coin, alpha)

    return jax.lax.scan(body, state, (batches, coins))

