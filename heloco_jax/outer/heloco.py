"""HeLoCo: MLA with a per-block directional correction against the outer
momentum (ALGORITHMS.md, "HeLoCo").

On each arrival, with m_b the momentum before the arrival:
  weight_order "before" (authors' code, default):  G = heloco_correct(ρ·Δ, m)
  weight_order "after"  (the paper's equations):   G = ρ·heloco_correct(Δ, m)
  m ← μ·m + (1 − μ)·G ;  θ ← θ − η·(G + μ·m)
Workers are dispatched from the look-ahead point θ − η·μ·m (always on for
HeLoCo): see ``heloco_jax.lookahead_params``.

A group of arrivals (a syncer's quorum; ``update(..., group_weights=w)`` with the arrivals
stacked) is merged, then corrected once (``merge_order="merge_then_correct"``, default), or
each arrival is corrected against the same m and the corrected updates merged
(``"correct_then_merge"``): ALGORITHMS.md, "Merge order under a quorum".
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple, Optional, get_args

import jax
import jax.numpy as jnp
import optax

from heloco_jax.outer import _validation, packing
from heloco_jax.outer import weighting as weighting_lib
from heloco_jax.outer.correction import (
  CorrectionInfo,
  RotateSchedule,
  Scope,
  correction_coefficients,
  heloco_correct,
  validate_correction_args,
)
from heloco_jax.outer.mla import (
  hyperparams_fields,
  momentum_step,
  validate_mla_args,
  zeros_momentum,
)

WeightOrder = Literal["before", "after"]
WEIGHT_ORDERS: tuple[str, ...] = get_args(WeightOrder)
MergeOrder = Literal["merge_then_correct", "correct_then_merge"]
MERGE_ORDERS: tuple[str, ...] = get_args(MergeOrder)


@dataclasses.dataclass(frozen=True)
class GroupedArrivalWeighting(weighting_lib.ArrivalWeighting):
  """ρ(τ) of a HeLoCo with ``merge_order="correct_then_merge"``, and that order: static, as
  ``ArrivalWeighting`` (the server reads the order from the state). The default order keeps
  ``ArrivalWeighting`` itself, so a default state's structure (a checkpoint's) is as before."""
  merge_order: MergeOrder = "correct_then_merge"


jax.tree_util.register_static(GroupedArrivalWeighting)


def merge_order_of(heloco_state: "HeLoCoState") -> MergeOrder:
  """The ``merge_order`` of the ``hj.heloco`` whose state is ``heloco_state``."""
  return getattr(heloco_state.rho, "merge_order", "merge_then_correct")


class HeLoCoState(NamedTuple):
  """State of ``heloco``; the diagnostics of the last arrival stay on device.

  Attributes:
    count: number of arrivals applied (int32; ``optax.safe_increment``: it
      stays at the int32 maximum instead of wrapping around).
    momentum: m, in ``accumulator_dtype`` (float32 by default, whatever the
      parameter dtype).
    learning_rate: η (float32 scalar).
    decay: μ (float32 scalar).
    staleness: τ of the last arrival (int32; 0 when not given).
    weight: ρ of the last arrival (float32).
    info: ``CorrectionInfo`` of the last arrival.
    rho: the arrival weight ρ(τ) it applies (static: no array); with
      ``merge_order="correct_then_merge"`` a ``GroupedArrivalWeighting`` that says so.
  """
  count: jax.Array
  momentum: Any
  learning_rate: jax.Array
  decay: jax.Array
  staleness: jax.Array
  weight: jax.Array
  info: CorrectionInfo
  rho: weighting_lib.ArrivalWeighting


def heloco(
    learning_rate: float = 0.7,
    momentum: float = 0.9,
    *,
    num_workers: Optional[int] = None,
    weighting: weighting_lib.Weighting = "constant",
    keep_threshold: float = 0.2,
    bad_threshold: float = -0.2,
    shrink_strength: float = 0.5,
    max_shrink: float = 0.5,
    rotate_strength: float = 1.0,
    confidence_scale: float = 3.0,
    eps: float = 1e-8,
    rotate_schedule: RotateSchedule = "normalized",
    weight_order: WeightOrder = "before",
    scope: Scope = "leaf",
    accumulator_dtype: Optional[Any] = None,
    merge_order: MergeOrder = "merge_then_correct",
) -> optax.GradientTransformationExtraArgs:
  """HeLoCo outer rule: corrected pseudo-gradients, then a momentum look-ahead step.

  Args:
    learning_rate: outer learning rate η > 0 (default 0.7).
    momentum: outer momentum μ in [0, 1) (default 0.9).
    num_workers: K for the arrival weight ρ; None means ρ = 1.
    weighting: "constant" (ρ = 1/√K, default), "polynomial" or "none".
    keep_threshold: c_ok in [−1, 1] (default 0.2); c_ok = −1 never corrects.
    bad_threshold: c_bad < c_ok (default −0.2), used by the normalized schedule.
    shrink_strength: k_s >= 0 (default 0.5).
    max_shrink: β_max in [0, 1] (default 0.5).
    rotate_strength: k_d >= 0 (default 1.0).
    confidence_scale: κ >= 0 (default 3.0).
    eps: ε > 0 (default 1e-8).
    rotate_schedule: "normalized" (default, authors' code) or "eq14".
    weight_order: "before" (ρ applied before the correction, default,
      authors' code) or "after" (the paper's G = ρ·Δ̂).
    scope: "leaf" (each leaf is a block, default) or "tree".
    accumulator_dtype: the dtype of m; None (default) keeps it in float32
      whatever the parameter dtype (unlike ``optax.trace``, whose None
      follows the parameters).
    merge_order: how a group of arrivals (``update``'s ``group_weights``) is taken:
      "merge_then_correct" (default; the HeLoCo authors' Decoupled HeLoCo, and the
      server's grouped update before this option) merges ρ(τ_j)/ρ(τ_max)·Δ_j with weights
      w_j and corrects the merged update once at τ_max; "correct_then_merge" corrects each
      arrival as it would be alone (against the same m) and merges the corrected updates
      with weights w_j. A single arrival is the same either way.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update(pseudo_grads,
    state, params=None, *, staleness=None, group_weights=None)`` returns
    ``−η·(G + μ·m)`` and a ``HeLoCoState`` whose ``info`` holds the diagnostics of this
    arrival. With ``group_weights`` (w_j ≥ 0, one per arrival, summing to 1 for a mean),
    ``pseudo_grads`` holds a group's arrivals stacked on a leading axis and ``staleness``
    their τ_j: one update for the group (``merge_order``); ``info`` then holds, for
    "correct_then_merge", the w-weighted means of the arrivals' diagnostics, the
    heaviest arrival's ``branch`` and the branch counts summed over the arrivals.

  Raises:
    ValueError: at construction, for an argument outside its allowed range.

  References:
    Al Asif et al., HeLoCo, arXiv 2606.00271 (2026); Ajanthan et al., MLA,
    OpenReview 4O8nzTkHPI; ALGORITHMS.md.

  Examples:
    Before the first arrival m = 0, so every block passes and the update
    is MLA's (ALGORITHMS.md, "useful identities"):

    >>> import jax.numpy as jnp
    >>> import heloco_jax as hj
    >>> params = {"b": jnp.zeros(2), "w": jnp.ones(3)}
    >>> delta = {"b": jnp.full(2, -0.1), "w": jnp.full(3, 0.2)}
    >>> tx = hj.heloco(learning_rate=0.7, momentum=0.9, num_workers=4)  # ρ = 1/2
    >>> state = tx.init(params)
    >>> updates, state = tx.update(delta, state, params, staleness=0)
    >>> mla = hj.mla(learning_rate=0.7, momentum=0.9, num_workers=4)
    >>> same, _ = mla.update(delta, mla.init(params), params, staleness=0)
    >>> round(float(updates["w"][0]), 4), round(float(same["w"][0]), 4)
    (-0.0763, -0.0763)

    A second arrival whose ``w`` opposes the momentum is shrunk; ``b``,
    aligned with it, is kept (blocks in ``jax.tree.leaves`` order):

    >>> delta = {"b": jnp.full(2, -0.1), "w": jnp.full(3, -0.2)}
    >>> updates, state = tx.update(delta, state, params, staleness=1)
    >>> [hj.BRANCH_NAMES[i] for i in state.info.branch.tolist()]
    ['keep', 'shrink']
  """
  num_workers = _validation.concrete_int(num_workers)  # e.g. from optax.inject_hyperparams
  validate_mla_args("heloco", learning_rate, momentum, num_workers, weighting, accumulator_dtype)
  correction_args = dict(
      keep_threshold=keep_threshold, bad_threshold=bad_threshold,
      shrink_strength=shrink_strength, max_shrink=max_shrink,
      rotate_strength=rotate_strength, confidence_scale=confidence_scale, eps=eps,
      rotate_schedule=rotate_schedule, scope=scope)
  validate_correction_args("heloco", **correction_args)
  _validation.check_choice("heloco", "weight_order", weight_order, WEIGHT_ORDERS)
  _validation.check_choice("heloco", "merge_order", merge_order, MERGE_ORDERS)
  correct_then_merge = merge_order == "correct_then_merge"

  def init_fn(params):
    m = zeros_momentum(params, accumulator_dtype)
    # Diagnostics of "no arrival yet": every field zero (branch_counts included).
    shapes = jax.eval_shape(lambda m: heloco_correct(m, m, **correction_args)[1], m)
    info = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return HeLoCoState(
        count=jnp.zeros((), jnp.int32), momentum=m,
        **hyperparams_fields(learning_rate, momentum),
        staleness=jnp.zeros((), jnp.int32), weight=jnp.ones((), jnp.float32), info=info,
        rho=(GroupedArrivalWeighting(num_workers, weighting) if correct_then_merge
             else weighting_lib.ArrivalWeighting(num_workers, weighting)))

  def rho_of(staleness):
    return weighting_lib.arrival_weight(staleness, num_workers=num_workers, weighting=weighting)

  def coefficients(pseudo_grads, m, rho):
    # "before": G = heloco_correct(ρΔ, m) (authors' code); "after": G = ρ·heloco_correct(Δ, m).
    scales = dict(input_scale=rho) if weight_order == "before" else dict(output_scale=rho)
    return correction_coefficients(pseudo_grads, m, **scales, **correction_args)

  def update_fn(pseudo_grads, state, params=None, *, staleness=None, group_weights=None,
                **extra_args):
    del params, extra_args
    if group_weights is not None:
      return group_update(pseudo_grads, state, staleness, group_weights)
    rho = rho_of(staleness)
    delta_scale, momentum_scale, info = coefficients(pseudo_grads, state.momentum, rho)
    return step(pseudo_grads, state, delta_scale, momentum_scale, staleness, rho, info)

  def step(pseudo_grads, state, delta_scale, momentum_scale, staleness, rho, info):
    updates, new_momentum = momentum_step(
        pseudo_grads, state.momentum, delta_scale, momentum_scale, learning_rate, momentum)
    return updates, state._replace(
        count=optax.safe_increment(state.count), momentum=new_momentum,
        **hyperparams_fields(learning_rate, momentum),
        staleness=weighting_lib.staleness_array(staleness), weight=rho, info=info)

  def group_update(stacked, state, staleness, group_weights):
    """One update for a group: arrivals stacked on axis 0, τ_j, w_j (ALGORITHMS.md)."""
    if staleness is None:
      staleness = jnp.zeros(jnp.shape(group_weights), jnp.int32)
    weights = jnp.asarray(group_weights, jnp.float32)
    rhos = jax.vmap(rho_of)(jnp.asarray(staleness, jnp.int32))
    tau_max = jnp.max(jnp.asarray(staleness, jnp.int32))
    if not correct_then_merge:  # ρ(τ_max)·Δ = Σ_j w_j·ρ(τ_j)·Δ_j, corrected once at τ_max
      rho_max = rho_of(tau_max)
      merged = _weighted_sum(stacked, weights * rhos / rho_max)
      delta_scale, momentum_scale, info = coefficients(merged, state.momentum, rho_max)
      return step(merged, state, delta_scale, momentum_scale, tau_max, rho_max, info)
    # G = Σ_j w_j·(A_j·Δ_j + B_j·m) = Σ_j (w_j·A_j)·Δ_j + (Σ_j w_j·B_j)·m, per leaf
    a, b, infos = jax.vmap(lambda d, rho: coefficients(d, state.momentum, rho))(stacked, rhos)
    merged = _weighted_sum(stacked, weights[:, None] * a)
    total = jnp.sum(weights)
    share = weights / jnp.where(total > 0, total, 1.0)
    mean = lambda x: jnp.tensordot(share, x, axes=1).astype(x.dtype)
    info = infos._replace(
        **{f: mean(getattr(infos, f)) for f in ("cosine", "confidence", "rotation", "shrinkage",
                                               "relative_correction",
                                               "total_relative_correction")},
        branch=infos.branch[jnp.argmax(weights)],
        branch_counts=jnp.sum(infos.branch_counts, axis=0, dtype=jnp.int32))
    return step(merged, state, 1.0, jnp.sum(weights[:, None] * b, axis=0), tau_max,
                jnp.sum(share * rhos), info)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _weighted_sum(stacked: Any, scales: jax.Array) -> Any:
  """Σ_j s_j·Δ_j (in at least float32) of arrivals stacked on axis 0, a tree or a ``Packed``;
  ``scales`` [n] (one per arrival) or [n, leaves] (per arrival and leaf)."""
  def scaled(delta, s):
    parts = packing.parts(delta)
    return parts.rebuild([weighting_lib.at_least_float32(x) * parts.take(s, i)
                          for i, x in enumerate(parts.arrays)])
  return jax.tree.map(lambda x: jnp.sum(x, axis=0), jax.vmap(scaled)(stacked, scales))
