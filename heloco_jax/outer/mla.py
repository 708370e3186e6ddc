"""Momentum look-ahead (MLA), the outer rule HeLoCo builds on (ALGORITHMS.md,
"Asynchronous methods").

  g = ρ·Δ ;  m ← μ·m + (1 − μ)·g ;  θ ← θ − η·(g + μ·m)

Look-ahead dispatch (an option of the dispatch rule, not of this transform)
starts workers from θ − η·μ·m: see ``heloco_jax.lookahead_params``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from heloco_jax.outer import _validation, packing
from heloco_jax.outer import weighting as weighting_lib


class MLAState(NamedTuple):
  """State of ``mla``.

  Attributes:
    count: number of arrivals applied (int32; ``optax.safe_increment``: it
      stays at the int32 maximum instead of wrapping around).
    momentum: m, in ``accumulator_dtype`` (float32 by default, whatever the
      parameter dtype).
    learning_rate: η (float32 scalar), kept so the look-ahead point can be
      formed from the state alone.
    decay: μ (float32 scalar).
    rho: the arrival weight ρ(τ) it applies (static: no array).
  """
  count: jax.Array
  momentum: Any
  learning_rate: jax.Array
  decay: jax.Array
  rho: weighting_lib.ArrivalWeighting


def momentum_dtype(accumulator_dtype: Optional[Any]) -> Any:
  """The outer momentum's dtype: float32 for None (the default), else the dtype given.

  Unlike ``optax.trace``, whose None follows the parameters, None keeps the
  momentum in float32 for bfloat16 parameters too: m sums many small weighted
  pseudo-gradients, which bfloat16's 8-bit mantissa would round away.
  """
  return jnp.float32 if accumulator_dtype is None else jnp.dtype(accumulator_dtype)


def zeros_momentum(params: Any, accumulator_dtype: Optional[Any] = None) -> Any:
  """Outer momentum m = 0 in ``momentum_dtype(accumulator_dtype)`` (float32 by default)."""
  return optax.tree_utils.tree_zeros_like(params, dtype=momentum_dtype(accumulator_dtype))


def momentum_step(pseudo_grads: Any, momentum: Any, delta_scale: Any, momentum_scale: Any,
                  learning_rate: Any, decay: Any) -> tuple[Any, Any]:
  """The MLA step on G = A·Δ + B·m; returns (−η·(G + μ·m'), m'). Shared by MLA and HeLoCo.

  ALGORITHMS.md (MLA): m' = μ·m + (1 − μ)·G and θ ← θ − η·(G + μ·m'). Written
  so that each output is one fused pass and the old momentum is read only
  by the pass that overwrites it (as in optax's Nesterov), which lets a
  server donate its state without XLA copying the momentum first:
    m'        = (1 − μ)A·Δ + k·m,               k = μ + (1 − μ)B
    G + μ·m'  = (μA/k)·Δ + (B/k + μ)·m'         (substituting m = (m' − (1 − μ)AΔ)/k)
  B >= 0 in every HeLoCo branch, so k >= μ; when k = 0 (μ = 0 and B = 0),
  G = m' and the update is −η·m'.

  Args:
    pseudo_grads: Δ (any float dtype; read in float32): a tree, or one packed by
      ``heloco_jax.outer.packing.pack`` (A and B then reach each leaf's rows).
    momentum: m before the arrival (float32 by default; m' keeps its dtype, computed in
      at least float32).
    delta_scale: A, a scalar or one scalar per leaf (``jax.tree.leaves`` order).
    momentum_scale: B >= 0, likewise (0 for plain MLA).
    learning_rate: η.
    decay: μ.
  """
  delta = packing.parts(pseudo_grads)  # a tree's leaves, or a Packed's buffers
  a = jnp.asarray(delta_scale, jnp.float32)
  b = jnp.asarray(momentum_scale, jnp.float32)
  k = decay + (1.0 - decay) * b
  safe_k = jnp.where(k > 0, k, 1.0)
  delta_gain = jnp.where(k > 0, decay * a / safe_k, 0.0)
  momentum_gain = jnp.where(k > 0, b / safe_k + decay, 1.0)
  per_leaf = delta.take
  updates, new_momentum = [], []
  for i, (x, m) in enumerate(zip(delta.arrays, delta.like(momentum))):
    x = weighting_lib.at_least_float32(x)
    m_new = ((1.0 - decay) * per_leaf(a, i) * x + per_leaf(k, i) * m).astype(m.dtype)
    new_momentum.append(m_new)
    updates.append(-learning_rate * (per_leaf(delta_gain, i) * x + per_leaf(momentum_gain, i) * m_new))
  return delta.rebuild(updates), delta.rebuild(new_momentum)


def hyperparams_fields(learning_rate, momentum) -> dict[str, jax.Array]:
  """η and μ as state fields: the look-ahead point uses the latest ones (so
  ``optax.inject_hyperparams`` schedules reach it too)."""
  return dict(learning_rate=jnp.asarray(learning_rate, jnp.float32),
              decay=jnp.asarray(momentum, jnp.float32))


def validate_mla_args(fn: str, learning_rate, momentum, num_workers, weighting_name,
                      accumulator_dtype) -> None:
  _validation.check_learning_rate(fn, learning_rate)
  _validation.check_momentum(fn, momentum)
  weighting_lib.validate_weighting(fn, num_workers, weighting_name)
  _validation.check_float_dtype(fn, "accumulator_dtype", accumulator_dtype)


def mla(
    learning_rate: float = 0.7,
    momentum: float = 0.9,
    *,
    num_workers: Optional[int] = None,
    weighting: weighting_lib.Weighting = "constant",
    accumulator_dtype: Optional[Any] = None,
) -> optax.GradientTransformationExtraArgs:
  """Momentum look-ahead outer rule for asynchronous pseudo-gradients.

  Args:
    learning_rate: outer learning rate η > 0 (default 0.7).
    momentum: outer momentum μ in [0, 1) (default 0.9).
    num_workers: K for the arrival weight ρ; None means ρ = 1.
    weighting: "constant" (ρ = 1/√K, default), "polynomial"
      (ρ = (1/√K)/√(1+τ)) or "none" (ρ = 1).
    accumulator_dtype: the dtype of m; None (default) keeps it in float32
      whatever the parameter dtype (unlike ``optax.trace``, whose None
      follows the parameters).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update(pseudo_grads,
    state, params=None, *, staleness=None)`` returns ``−η·(g + μ·m)``.

  Raises:
    ValueError: at construction, for an argument outside its allowed range.

  References:
    Ajanthan et al., Momentum Look-Ahead for Asynchronous Distributed
    Low-Communication Training, ICLR 2025 MCDC workshop (OpenReview
    4O8nzTkHPI); ALGORITHMS.md ("MLA").

  Examples:
    >>> import jax.numpy as jnp
    >>> import heloco_jax as hj
    >>> tx = hj.mla(learning_rate=0.7, momentum=0.9, num_workers=4)  # ρ = 1/2
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.full(2, 0.2)}, state, params, staleness=3)
    >>> # g = 0.1, m = (1 − μ)·g = 0.01, update = −η·(g + μ·m)
    >>> round(float(hj.outer_momentum(state)["w"][0]), 4)
    0.01
    >>> round(float(updates["w"][0]), 4)
    -0.0763
  """
  num_workers = _validation.concrete_int(num_workers)  # e.g. from optax.inject_hyperparams
  validate_mla_args("mla", learning_rate, momentum, num_workers, weighting, accumulator_dtype)

  def init_fn(params):
    return MLAState(count=jnp.zeros((), jnp.int32),
                    momentum=zeros_momentum(params, accumulator_dtype),
                    **hyperparams_fields(learning_rate, momentum),
                    rho=weighting_lib.ArrivalWeighting(num_workers, weighting))

  def update_fn(pseudo_grads, state, params=None, *, staleness=None, **extra_args):
    del params, extra_args
    rho = weighting_lib.arrival_weight(staleness, num_workers=num_workers, weighting=weighting)
    updates, new_momentum = momentum_step(pseudo_grads, state.momentum, rho, 0.0,
                                          learning_rate, momentum)
    return updates, state._replace(count=optax.safe_increment(state.count),
                                   momentum=new_momentum,
                                   **hyperparams_fields(learning_rate, momentum))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
