"""Asynchronous DiLoCo with Nesterov outer momentum (ALGORITHMS.md, "Async
DiLoCo, Nesterov").

Per arrival, the synchronous DiLoCo rule applied to g = ρ·Δ, exactly as
``optax.sgd(η, momentum=μ, nesterov=True)``:
  m ← μ·m + g ;  θ ← θ − η·(g + μ·m)
"""

from __future__ import annotations

from typing import Any, Optional

import optax

from heloco_jax.outer import _validation
from heloco_jax.outer import weighting as weighting_lib
from heloco_jax.outer.mla import momentum_dtype


def async_nesterov(
    learning_rate: float = 0.07,
    momentum: float = 0.9,
    *,
    num_workers: Optional[int] = None,
    weighting: weighting_lib.Weighting = "constant",
    accumulator_dtype: Optional[Any] = None,
) -> optax.GradientTransformationExtraArgs:
  """Nesterov outer rule applied to every weighted arrival.

  Args:
    learning_rate: outer learning rate η > 0 (default 0.07, the value the
      HeLoCo authors' harness uses for this baseline).
    momentum: outer momentum μ in [0, 1) (default 0.9).
    num_workers: K for the arrival weight ρ; None means ρ = 1.
    weighting: "constant" (ρ = 1/√K, default), "polynomial" or "none".
    accumulator_dtype: the dtype of the momentum (optax's trace); None
      (default) keeps it in float32 whatever the parameter dtype (unlike
      ``optax.sgd``, whose None follows the parameters).

  Returns:
    ``optax.chain(scale_by_arrival_weight(...), optax.sgd(η, μ,
    nesterov=True, accumulator_dtype=...))``; its ``update`` takes
    ``staleness=``.

  Raises:
    ValueError: at construction, for an argument outside its allowed range.

  References:
    Liu et al., Asynchronous Local-SGD Training for Language Modeling, arXiv
    2401.09135; Douillard et al., DiLoCo, arXiv 2311.08105.

  Examples:
    The rule is optax's Nesterov SGD applied to g = ρ·Δ:

    >>> import jax.numpy as jnp
    >>> import optax
    >>> import heloco_jax as hj
    >>> tx = hj.async_nesterov(learning_rate=0.07, momentum=0.9, num_workers=4)
    >>> sgd = optax.sgd(0.07, momentum=0.9, nesterov=True)
    >>> params, delta = {"w": jnp.ones(2)}, {"w": jnp.full(2, 0.2)}
    >>> updates, _ = tx.update(delta, tx.init(params), params, staleness=0)
    >>> want, _ = sgd.update({"w": 0.5 * delta["w"]}, sgd.init(params), params)
    >>> round(float(updates["w"][0]), 5), round(float(want["w"][0]), 5)
    (-0.0133, -0.0133)
  """
  num_workers = _validation.concrete_int(num_workers)  # e.g. from optax.inject_hyperparams
  _validation.check_learning_rate("async_nesterov", learning_rate)
  _validation.check_momentum("async_nesterov", momentum)
  weighting_lib.validate_weighting("async_nesterov", num_workers, weighting)
  _validation.check_float_dtype("async_nesterov", "accumulator_dtype", accumulator_dtype)
  return optax.chain(
      weighting_lib.scale_by_arrival_weight(num_workers, weighting),
      optax.sgd(learning_rate, momentum=momentum, nesterov=True,
                accumulator_dtype=momentum_dtype(accumulator_dtype)),
  )
