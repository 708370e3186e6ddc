"""The HeLoCo directional correction, pure math (ALGORITHMS.md, "The HeLoCo
correction of one block b").

For a block with update d and reference momentum m_b (the momentum *before*
the arrival):

  c    = <d, m_b> / (|d| |m_b|)
  conf = |d| / (|d| + κ|m_b| + ε)
  pass    if |d| < ε or |m_b| < ε:  d̂ = d
  keep    if c >= c_ok:              d̂ = d
  shrink  if c < 0:                  β = min(k_s (−c) conf, β_max)
                                     d̂ = d − β c |d| m_b/|m_b|
  rotate  otherwise (0 <= c < c_ok): λ = min(k_d r(c) conf, 1)
                                     u = (1−λ) d/|d| + λ m_b/|m_b|
                                     d̂ = |d| u / max(|u|, ε)

with r(c) = clip((c_ok − c)/(c_ok − c_bad), 0, 1) ("normalized", default) or
r(c) = 1 − c ("eq14").

Implementation note: every branch gives d̂ = a·d + b·m_b with two scalars
(a, b) per block, and |u|² = (1−λ)² + λ² + 2λ(1−λ)c because d/|d| and
m_b/|m_b| are unit vectors with cosine c. So a block costs three
reductions (<d,m>, |d|², |m|²), a few vector ops shared by all blocks, and
its share of the elementwise passes of the momentum step (``heloco`` folds
a and b into them), with no Python branching on traced values.

References:
  Al Asif et al., HeLoCo, arXiv 2606.00271 (2026), Eq. 14 and the authors'
  experiment code.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp

from heloco_jax.outer import _validation, packing
from heloco_jax.outer.weighting import at_least_float32

# Branch codes, in the order used by ``CorrectionInfo.branch_counts``.
PASS, KEEP, SHRINK, ROTATE = 0, 1, 2, 3
BRANCH_NAMES = ("pass", "keep", "shrink", "rotate")
RotateSchedule = Literal["normalized", "eq14"]
Scope = Literal["leaf", "tree"]
ROTATE_SCHEDULES: tuple[str, ...] = get_args(RotateSchedule)
SCOPES: tuple[str, ...] = get_args(Scope)


class CorrectionInfo(NamedTuple):
  """Diagnostics of one correction (ALGORITHMS.md, "Diagnostics").

  Per-block fields are float32 (``branch``: int32) vectors with one entry per
  block: per leaf of the pseudo-gradients in ``jax.tree.leaves`` order when
  ``scope="leaf"`` (``block_names`` gives their names), and one entry when
  ``scope="tree"``. Vectors rather than per-leaf scalars keep the compiled
  update at a handful of kernels whatever the number of leaves, and log in
  one device-to-host transfer per field.

  Attributes:
    cosine: c per block, clipped to [-1, 1]; 0 for blocks that passed.
    confidence: conf per block.
    branch: int32 per block: 0 pass, 1 keep, 2 shrink, 3 rotate.
    rotation: λ per block; 0 where the block did not rotate.
    shrinkage: β per block; 0 where the block did not shrink.
    relative_correction: |d̂_b − d_b| / |d_b| per block; 0 for pass.
    branch_counts: int32[4], the number of blocks per branch (pass, keep,
      shrink, rotate).
    total_relative_correction: |d̂ − d| / |d| over the whole tree (equals
      |G − ρΔ| / |ρΔ| in either weight order); 0 when |d| < ε.
  """
  cosine: Any
  confidence: Any
  branch: Any
  rotation: Any
  shrinkage: Any
  relative_correction: Any
  branch_counts: jax.Array
  total_relative_correction: jax.Array


def validate_correction_args(
    fn: str,
    *,
    keep_threshold: float,
    bad_threshold: float,
    shrink_strength: float,
    max_shrink: float,
    rotate_strength: float,
    confidence_scale: float,
    eps: float,
    rotate_schedule: RotateSchedule,
    scope: Scope,
) -> None:
  """Construction-time checks of the correction keywords."""
  _validation.check_range(fn, "keep_threshold", keep_threshold, -1.0, 1.0)
  _validation.check_range(fn, "bad_threshold", bad_threshold)
  _validation.check_choice(fn, "rotate_schedule", rotate_schedule, ROTATE_SCHEDULES)
  _validation.check_choice(fn, "scope", scope, SCOPES)
  if (rotate_schedule == "normalized"
      and not isinstance(keep_threshold, jax.core.Tracer)
      and not isinstance(bad_threshold, jax.core.Tracer)
      and not float(bad_threshold) < float(keep_threshold)):
    raise ValueError(
        f"{fn}: bad_threshold={bad_threshold!r} is not allowed; allowed: a number "
        f"< keep_threshold={keep_threshold!r} with rotate_schedule='normalized' "
        "(r(c) divides by keep_threshold - bad_threshold).")
  _validation.check_range(fn, "shrink_strength", shrink_strength, 0.0)
  _validation.check_range(fn, "max_shrink", max_shrink, 0.0, 1.0)
  _validation.check_range(fn, "rotate_strength", rotate_strength, 0.0)
  _validation.check_range(fn, "confidence_scale", confidence_scale, 0.0)
  _validation.check_range(fn, "eps", eps, 0.0, low_open=True)


def block_names(tree: Any, scope: Scope = "leaf") -> list[str]:
  """Names of the blocks of ``CorrectionInfo``'s vectors: leaf paths, or ["tree"]."""
  if scope == "tree":
    return ["tree"]
  return ["/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
          for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def _leaf_sums(delta: jax.Array, m: jax.Array) -> jax.Array:
  """[<Δ, m>, |Δ|², |m|²] of one leaf, each a single reduction pass."""
  delta = at_least_float32(delta)
  return jnp.stack([jnp.vdot(delta, m), jnp.vdot(delta, delta), jnp.vdot(m, m)])


def _coefficients(dot, d_sq, m_sq, *, keep_threshold, bad_threshold,
                  shrink_strength, max_shrink, rotate_strength,
                  confidence_scale, eps, rotate_schedule):
  """Vectors (a, b) with d̂_b = a_b·d_b + b_b·m_b, and the blocks' diagnostics.

  Every argument is a vector with one entry per block, so the branch logic
  compiles to a handful of vector ops whatever the number of leaves.
  """
  d_norm = jnp.sqrt(d_sq)
  m_norm = jnp.sqrt(m_sq)
  passed = (d_norm < eps) | (m_norm < eps)
  safe_d_norm = jnp.where(passed, 1.0, d_norm)
  safe_m_norm = jnp.where(passed, 1.0, m_norm)
  cosine = jnp.where(passed, 0.0, jnp.clip(dot / (safe_d_norm * safe_m_norm), -1.0, 1.0))
  confidence = d_norm / (d_norm + confidence_scale * m_norm + eps)

  keep = ~passed & (cosine >= keep_threshold)
  shrink = ~passed & ~keep & (cosine < 0)
  rotate = ~passed & ~keep & ~shrink
  branch = jnp.select([passed, keep, shrink], [PASS, KEEP, SHRINK], ROTATE).astype(jnp.int32)

  # Shrink branch: d̂ = d − β c |d| m_b/|m_b|.
  shrinkage = jnp.where(shrink, jnp.minimum(shrink_strength * -cosine * confidence, max_shrink), 0.0)
  # Rotate branch: λ = min(k_d r(c) conf, 1); d̂ = |d| u / max(|u|, ε).
  if rotate_schedule == "normalized":
    schedule = jnp.clip((keep_threshold - cosine) / (keep_threshold - bad_threshold), 0.0, 1.0)
  else:  # "eq14"
    schedule = 1.0 - cosine
  rotation = jnp.where(rotate, jnp.minimum(rotate_strength * schedule * confidence, 1.0), 0.0)
  u_norm = jnp.sqrt(jnp.maximum(
      (1.0 - rotation) ** 2 + rotation ** 2 + 2.0 * rotation * (1.0 - rotation) * cosine, 0.0))
  rotate_scale = d_norm / jnp.maximum(u_norm, eps)

  a = jnp.where(rotate, rotate_scale * (1.0 - rotation) / safe_d_norm, 1.0)
  b = jnp.where(shrink, -shrinkage * cosine * d_norm / safe_m_norm,
                jnp.where(rotate, rotate_scale * rotation / safe_m_norm, 0.0))
  # |d̂ − d|² = (a−1)²|d|² + b²|m|² + 2(a−1)b<d,m>, from the same scalars.
  change_sq = jnp.maximum((a - 1.0) ** 2 * d_sq + b ** 2 * m_sq + 2.0 * (a - 1.0) * b * dot, 0.0)
  info = dict(cosine=cosine, confidence=confidence, branch=branch, rotation=rotation,
              shrinkage=shrinkage, relative_correction=jnp.sqrt(change_sq) / safe_d_norm)
  return a, b, change_sq, info


def heloco_correct(
    pseudo_grads: Any,
    momentum: Any,
    *,
    keep_threshold: float = 0.2,
    bad_threshold: float = -0.2,
    shrink_strength: float = 0.5,
    max_shrink: float = 0.5,
    rotate_strength: float = 1.0,
    confidence_scale: float = 3.0,
    eps: float = 1e-8,
    rotate_schedule: RotateSchedule = "normalized",
    scope: Scope = "leaf",
) -> tuple[Any, CorrectionInfo]:
  """Applies the HeLoCo per-block correction to ``pseudo_grads``.

  Pure function: no state, no weighting (``heloco`` applies ρ before or
  after calling it, see ``weight_order``). jit- and vmap-compatible.

  Named ``heloco_correct`` rather than ``correct``: at the top level
  (``hj.heloco_correct``) a bare ``correct`` says neither what is corrected
  nor by which rule, and the prefix groups it with ``hj.heloco`` and
  ``hj.heloco_diagnostics``, the other two names of the same method.

  Args:
    pseudo_grads: the update d (any pytree of floating arrays; any dtype), or a
      tree packed by ``heloco_jax.outer.packing.pack`` (blocks are still its leaves).
    momentum: the reference m (same structure, packed alike), the outer momentum
      before this arrival.
    keep_threshold: c_ok, blocks with c >= c_ok are kept.
    bad_threshold: c_bad, the lower end of the "normalized" rotation schedule.
    shrink_strength: k_s.
    max_shrink: β_max in [0, 1].
    rotate_strength: k_d.
    confidence_scale: κ.
    eps: ε, the norm below which a block passes unchanged.
    rotate_schedule: "normalized" (authors' code, default) or "eq14" (the
      paper's printed Eq. 14, r(c) = 1 − c).
    scope: "leaf" (each pytree leaf is a block, default) or "tree" (the
      whole update is one block).

  Returns:
    ``(corrected, info)``: d̂ with the structure of ``pseudo_grads`` in
    float32 (or wider), and a ``CorrectionInfo``.

  References:
    Al Asif et al., HeLoCo, arXiv 2606.00271; ALGORITHMS.md.

  Examples:
    Block ``a`` is aligned with the momentum and kept; block ``b`` is
    orthogonal to it (c = 0) and rotates toward it with its norm kept:
    conf = 1/(1 + κ) = 0.25, r(0) = 0.5, so λ = 0.125.

    >>> import jax.numpy as jnp
    >>> import heloco_jax as hj
    >>> d = {"a": jnp.array([1.0, 0.0]), "b": jnp.array([0.0, 1.0])}
    >>> m = {"a": jnp.array([1.0, 0.0]), "b": jnp.array([1.0, 0.0])}
    >>> corrected, info = hj.heloco_correct(d, m)
    >>> [hj.BRANCH_NAMES[i] for i in info.branch.tolist()]
    ['keep', 'rotate']
    >>> float(info.rotation[1])
    0.125
    >>> [round(x, 4) for x in corrected["b"].tolist()]
    [0.1414, 0.9899]
    >>> round(float(jnp.linalg.norm(corrected["b"])), 5)
    1.0
  """
  validate_correction_args(
      "heloco_correct", keep_threshold=keep_threshold, bad_threshold=bad_threshold,
      shrink_strength=shrink_strength, max_shrink=max_shrink,
      rotate_strength=rotate_strength, confidence_scale=confidence_scale,
      eps=eps, rotate_schedule=rotate_schedule, scope=scope)
  hyper = dict(keep_threshold=keep_threshold, bad_threshold=bad_threshold,
               shrink_strength=shrink_strength, max_shrink=max_shrink,
               rotate_strength=rotate_strength, confidence_scale=confidence_scale,
               eps=eps, rotate_schedule=rotate_schedule)
  delta_scale, momentum_scale, info = correction_coefficients(
      pseudo_grads, momentum, scope=scope, **hyper)
  delta = packing.parts(pseudo_grads)
  corrected = [delta.take(delta_scale, i) * at_least_float32(x) + delta.take(momentum_scale, i) * m
               for i, (x, m) in enumerate(zip(delta.arrays, delta.like(momentum)))]
  return delta.rebuild(corrected), info


def correction_coefficients(
    pseudo_grads: Any, momentum: Any, *, input_scale: Any = 1.0, output_scale: Any = 1.0,
    scope: Scope, **hyper,
) -> tuple[jax.Array, jax.Array, CorrectionInfo]:
  """Per-leaf scalars (A, B) with ``output_scale·heloco_correct(input_scale·Δ, m) = A·Δ + B·m``.

  The block sums are taken on Δ once and scaled (<sΔ, m> = s<Δ, m>,
  |sΔ|² = s²|Δ|²), so neither ``input_scale·Δ`` nor the corrected update
  has to be materialised: ``heloco`` folds A and B straight into the
  momentum step. Arguments are assumed valid.

  Args:
    pseudo_grads: Δ.
    momentum: m before the arrival.
    input_scale: s, the correction sees s·Δ.
    output_scale: the corrected update is multiplied by it.
    scope: "leaf" or "tree".
    **hyper: the correction keywords of ``heloco_correct``.

  Returns:
    ``(A, B, info)``: A and B are float32 vectors with one entry per leaf
    (``jax.tree.leaves`` order); ``info`` the diagnostics.
  """
  delta = packing.parts(pseudo_grads)
  num_leaves = delta.num_leaves
  if isinstance(pseudo_grads, packing.Packed):  # row sums, then a sum per leaf
    leaf_sums = packing.leaf_sums(pseudo_grads, momentum, at_least_float32)
  else:
    leaf_sums = (jnp.stack([_leaf_sums(x, m) for x, m in zip(delta.arrays, delta.like(momentum))])
                 if delta.arrays else jnp.zeros((0, 3), jnp.float32))
  sums = leaf_sums * jnp.stack([input_scale, input_scale ** 2, 1.0]).astype(leaf_sums.dtype)
  if scope == "tree":
    sums = jnp.sum(sums, axis=0, keepdims=True)
  a, b, change_sq, per_block = _coefficients(sums[:, 0], sums[:, 1], sums[:, 2], **hyper)
  delta_scale = a * (input_scale * output_scale)
  momentum_scale = b * output_scale
  if scope == "tree":  # one block: the same coefficients for every leaf
    delta_scale = jnp.broadcast_to(delta_scale, (num_leaves,))
    momentum_scale = jnp.broadcast_to(momentum_scale, (num_leaves,))

  branch_counts = jnp.sum(per_block["branch"][:, None] == jnp.arange(4), axis=0, dtype=jnp.int32)
  total_d_norm = jnp.sqrt(jnp.sum(sums[:, 1]))
  eps = hyper["eps"]
  total_relative = jnp.where(total_d_norm < eps, 0.0,
                             jnp.sqrt(jnp.sum(change_sq)) / jnp.maximum(total_d_norm, eps))
  info = CorrectionInfo(**per_block, branch_counts=branch_counts,
                        total_relative_correction=total_relative)
  return delta_scale, momentum_scale, info
