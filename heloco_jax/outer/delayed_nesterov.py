"""Delayed Nesterov, DN (Liu et al., Alg. 3; ALGORITHMS.md, "Delayed Nesterov").

State m, buffer D (both float32 by default, start 0) and arrival counter t. On arrival:
  t ← t + 1 ;  D ← D + g
  if t mod N = 0:  m ← μ·m + D/N ;  θ ← θ − η·[(1 − c·N + c)·μ·m + g/N] ;  D ← 0
  else:            θ ← θ − η·[c·μ·m + g/N]
With N = 1 this is exactly the Nesterov rule, for any c.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from heloco_jax.outer import _validation
from heloco_jax.outer import weighting as weighting_lib
from heloco_jax.outer.mla import zeros_momentum


class DelayedNesterovState(NamedTuple):
  """State of ``delayed_nesterov``.

  Attributes:
    count: arrival counter t (int32; ``optax.safe_increment``: it stays at
      the int32 maximum instead of wrapping around, after 2^31 − 1 arrivals).
    momentum: m, in ``accumulator_dtype`` (float32 by default).
    buffer: D, the sum of the weighted arrivals since the last momentum
      update, in ``accumulator_dtype`` (float32 by default).
    rho: the arrival weight ρ(τ) it applies (static: no array).
  """
  count: jax.Array
  momentum: Any
  buffer: Any
  rho: weighting_lib.ArrivalWeighting


def delayed_nesterov(
    learning_rate: float,
    momentum: float = 0.9,
    *,
    buffer_size: Optional[int] = None,
    c: float = 0.0,
    num_workers: Optional[int] = None,
    weighting: weighting_lib.Weighting = "constant",
    accumulator_dtype: Optional[Any] = None,
) -> optax.GradientTransformationExtraArgs:
  """Delayed Nesterov outer rule: momentum refreshed every N arrivals.

  Args:
    learning_rate: outer learning rate η > 0.
    momentum: outer momentum μ in [0, 1) (default 0.9).
    buffer_size: N >= 1; defaults to ``num_workers`` (N = K, ALGORITHMS.md).
    c: weight of the momentum applied between refreshes, in [0, 1/N]
      (default 0).
    num_workers: K for the arrival weight ρ; None means ρ = 1.
    weighting: "constant" (ρ = 1/√K, default), "polynomial" or "none".
    accumulator_dtype: the dtype of m and D; None (default) keeps them in
      float32 whatever the parameter dtype (unlike ``optax.trace``, whose
      None follows the parameters).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` taking ``staleness=``.

  Raises:
    ValueError: at construction, for an argument outside its allowed range,
      or when neither ``buffer_size`` nor ``num_workers`` is given.

  References:
    Liu et al., Asynchronous Local-SGD Training for Language Modeling, arXiv
    2401.09135, Algorithm 3.

  Examples:
    With N = 2 and c = 0, the first arrival moves θ by −η·g/N only; the
    second refreshes the momentum with the buffered mean:

    >>> import jax.numpy as jnp
    >>> import heloco_jax as hj
    >>> tx = hj.delayed_nesterov(learning_rate=0.1, momentum=0.9, buffer_size=2)
    >>> params = {"w": jnp.zeros(1)}
    >>> state = tx.init(params)
    >>> for _ in range(2):
    ...   updates, state = tx.update({"w": jnp.ones(1)}, state, params)
    ...   print(round(float(updates["w"][0]), 4), float(hj.outer_momentum(state)["w"][0]))
    -0.05 0.0
    -0.14 1.0
  """
  fn = "delayed_nesterov"
  # Concrete 0-d integer arrays (e.g. from optax.inject_hyperparams) as ints.
  num_workers = _validation.concrete_int(num_workers)
  buffer_size = _validation.concrete_int(buffer_size)
  _validation.check_learning_rate(fn, learning_rate)
  _validation.check_momentum(fn, momentum)
  weighting_lib.validate_weighting(fn, num_workers, weighting)
  _validation.check_float_dtype(fn, "accumulator_dtype", accumulator_dtype)
  if buffer_size is None:
    if num_workers is None:
      raise ValueError(f"{fn}: buffer_size=None is not allowed when num_workers=None; "
                       "allowed: an integer >= 1 (the default N = K needs num_workers).")
    buffer_size = num_workers
  _validation.check_positive_int(fn, "buffer_size", buffer_size, allow_none=False)
  # c <= 1/N, also when c is 1/N rounded up to float32 (inject_hyperparams
  # holds c as a float32 array); a traced N cannot be read: then only c >= 0.
  if isinstance(buffer_size, jax.core.Tracer):
    c_max = math.inf
  else:
    c_max = max(1.0 / buffer_size, float(np.float32(1.0 / buffer_size)))
  _validation.check_range(fn, "c", c, 0.0, c_max)
  flush_coefficient = (1.0 - c * buffer_size + c) * momentum
  between_coefficient = c * momentum

  def init_fn(params):
    # Two distinct trees: the state must be donatable (no aliased buffers).
    return DelayedNesterovState(count=jnp.zeros((), jnp.int32),
                                momentum=zeros_momentum(params, accumulator_dtype),
                                buffer=zeros_momentum(params, accumulator_dtype),
                                rho=weighting_lib.ArrivalWeighting(num_workers, weighting))

  def update_fn(pseudo_grads, state, params=None, *, staleness=None, **extra_args):
    del params, extra_args
    g, _ = weighting_lib.apply_arrival_weight(
        pseudo_grads, staleness, num_workers=num_workers, weighting=weighting)
    count = optax.safe_increment(state.count)
    flush = count % buffer_size == 0
    # m and D keep their dtype (computed in at least float32).
    buffer = jax.tree.map(lambda d, x: (d + x).astype(d.dtype), state.buffer, g)
    new_momentum = jax.tree.map(
        lambda m, d: jnp.where(flush, momentum * weighting_lib.at_least_float32(m)
                               + weighting_lib.at_least_float32(d) / buffer_size, m
                               ).astype(m.dtype),
        state.momentum, buffer)
    coefficient = jnp.where(flush, flush_coefficient, between_coefficient)
    updates = jax.tree.map(
        lambda m, x: -learning_rate * (coefficient * m + x / buffer_size), new_momentum, g)
    buffer = jax.tree.map(lambda d: jnp.where(flush, jnp.zeros_like(d), d), buffer)
    return updates, DelayedNesterovState(count, new_momentum, buffer, state.rho)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
