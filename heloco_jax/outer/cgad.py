"""CGAD: Cosine-Gated Adam-Decay, an age-gated Adam outer step (ALGORITHMS.md, "CGAD").

On each arrival with staleness τ:
  σ(τ) = γ(τ)·exp(−α·τ),  γ(τ) = ½(1 + cos(π·τ/τ_c)) for τ < τ_c, else 0
  g = σ(τ)·Δ ;  m ← β₁m + (1 − β₁)g ;  v ← β₂v + (1 − β₂)g²
  θ ← θ − η·m̂/(√v̂ + ε)   (m̂, v̂ bias-corrected, as optax.adam)
With fragments each fragment has its own server, so its own moments and its
own age τ_p (the per-fragment variant, PA-CGAD).
"""

from __future__ import annotations

from typing import Any, Optional

import optax

from heloco_jax.outer import _validation
from heloco_jax.outer import weighting as weighting_lib


def cgad(
    learning_rate: float = 1e-3,
    b1: float = 0.9,
    b2: float = 0.99,
    eps: float = 1e-8,
    *,
    decay: float = 0.1,
    cutoff: float = 32.0,
    accumulator_dtype: Optional[Any] = None,
) -> optax.GradientTransformationExtraArgs:
  """CGAD's outer rule: Adam on age-gated pseudo-gradients.

  Args:
    learning_rate: outer learning rate η > 0.
    b1: β₁ in [0, 1), the first moment's decay.
    b2: β₂ in [0, 1), the second moment's decay.
    eps: ε > 0 of Adam's denominator.
    decay: α ≥ 0 of σ(τ) = γ(τ)·exp(−α·τ).
    cutoff: τ_c > 0, the staleness from which γ(τ) = 0; ``math.inf`` gives
      Adam-Decay (σ = exp(−α·τ), CGAD without the cutoff).
    accumulator_dtype: the dtype of the first moment (optax's ``mu_dtype``);
      None keeps it in float32 whatever the parameter dtype.

  Returns:
    ``optax.chain(hj.scale_by_age_gate(decay, cutoff), optax.scale_by_adam(b1, b2,
    eps, mu_dtype=...), optax.scale_by_learning_rate(η))``; its ``update`` takes
    ``staleness=``. At τ = 0 it is ``optax.adam(η, b1, b2, eps)``. An arrival past
    the cutoff contributes g = 0 but is still a step: the moments decay and θ
    moves by η·m̂/(√v̂ + ε).

  Raises:
    ValueError: at construction, for an argument outside its allowed range.

  References:
    Shah and Sun, Cosine-Gated Adam-Decay: Drop-In Staleness-Aware Outer
    Optimization for Decoupled DiLoCo, arXiv 2605.09126 (σ(τ) and the Adam
    moments from its abstract; the gate's shape and every default are ours:
    ALGORITHMS.md, "CGAD").

  Examples:
    At τ = 0 CGAD is Adam:

    >>> import jax.numpy as jnp
    >>> import optax
    >>> import heloco_jax as hj
    >>> tx, adam = hj.cgad(0.01), optax.adam(0.01, b1=0.9, b2=0.99)
    >>> params, delta = {"w": jnp.ones(2)}, {"w": jnp.array([0.2, -0.1])}
    >>> u, _ = tx.update(delta, tx.init(params), params, staleness=0)
    >>> want, _ = adam.update(delta, adam.init(params), params)
    >>> bool(jnp.all(u["w"] == want["w"]))
    True
  """
  _validation.check_learning_rate("cgad", learning_rate)
  _validation.check_range("cgad", "b1", b1, 0.0, 1.0, high_open=True)
  _validation.check_range("cgad", "b2", b2, 0.0, 1.0, high_open=True)
  _validation.check_range("cgad", "eps", eps, 0.0, low_open=True)
  weighting_lib.validate_age_gate("cgad", decay, cutoff)
  _validation.check_float_dtype("cgad", "accumulator_dtype", accumulator_dtype)
  return optax.chain(
      weighting_lib.scale_by_age_gate(decay, cutoff),
      optax.scale_by_adam(b1, b2, eps, mu_dtype=accumulator_dtype or "float32"),
      optax.scale_by_learning_rate(learning_rate),
  )

