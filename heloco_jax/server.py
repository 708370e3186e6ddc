"""The server side of every runtime: θ, the outer state and the jitted outer rule.

``OuterServer`` is what the scheduler (``heloco_jax.scheduler``) calls for
everything that touches θ: the dispatch point (θ, or the look-ahead point
θ − η·μ·m, ALGORITHMS.md "MLA"), and one ``update`` per arrival group, which
rejects non-finite pseudo-gradients, measures cos(Δ, m), combines a grace
window's arrivals and applies the outer rule. ``runtime=simulated`` and
``runtime=devices`` run it in the scheduler's process; ``runtime=ray`` runs
the same class as the parameter-server actor (``heloco_jax.ray_runtime``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from heloco_jax import outer
from heloco_jax.methods import METHODS

Row = dict[str, Any]


def poison(tree: Any, value: str, worker: Optional[int] = None) -> Any:
  """``tree`` with its first leaf's first element (of ``worker``'s slice) set to NaN or Inf."""
  leaves, treedef = jax.tree.flatten(tree)
  index = (0,) * leaves[0].ndim if worker is None else (worker,) + (0,) * (leaves[0].ndim - 1)
  leaves[0] = jnp.asarray(leaves[0]).at[index].set(jnp.nan if value == "nan" else jnp.inf)
  return jax.tree.unflatten(treedef, leaves)


@functools.partial(jax.jit, static_argnames="per_worker")
def nonfinite(tree: Any, per_worker: bool = False) -> tuple[jax.Array, jax.Array]:
  """(has NaN, has ±Inf) over ``tree``; per slice of the leading axis if ``per_worker``."""
  def any_of(test):
    flags = [test(x).reshape((x.shape[0], -1) if per_worker else (-1,)).any(axis=-1)
             for x in jax.tree.leaves(tree)]
    return jnp.any(jnp.stack(flags), axis=0)
  return any_of(jnp.isnan), any_of(jnp.isinf)


def reasons(has_nan: Any, has_inf: Any) -> list[Optional[str]]:
  """Per pseudo-gradient: None if finite, else "nan" or "inf"."""
  has_nan, has_inf = np.atleast_1d(has_nan), np.atleast_1d(has_inf)
  return ["nan" if n else "inf" if i else None for n, i in zip(has_nan, has_inf)]


@jax.jit
def alignment(delta: Any, momentum: Any) -> jax.Array:
  """Mean over leaves of cos(Δ_leaf, m_leaf); a leaf with Δ or m zero counts 0."""
  cosines = []
  for d, m in zip(jax.tree.leaves(delta), jax.tree.leaves(momentum)):
    d, m = d.astype(jnp.float32).ravel(), m.astype(jnp.float32).ravel()
    norms = jnp.linalg.norm(d) * jnp.linalg.norm(m)
    cosines.append(jnp.where(norms > 0, jnp.dot(d, m) / jnp.where(norms > 0, norms, 1.0), 0.0))
  return jnp.mean(jnp.stack(cosines))


@jax.jit
def heloco_diagnostics(info: Any, weight: jax.Array) -> dict[str, jax.Array]:
  """HeLoCo's per-arrival diagnostics summarised over blocks, as device scalars.

  Fresh buffers, so they outlive the next outer step (which donates the
  state holding ``info``) and can be fetched later, in a batch (``to_host``).
  """
  def masked_mean(values, mask):
    count = jnp.sum(mask)
    return jnp.where(count > 0, jnp.sum(jnp.where(mask, values, 0.0)) / jnp.maximum(count, 1), 0.0)
  row = {f"branch_count/{name}": info.branch_counts[i]
         for i, name in enumerate(outer.BRANCH_NAMES)}
  branch = outer.BRANCH_NAMES.index
  row.update({
      "cosine_mean": jnp.mean(info.cosine),
      "rotation_mean": masked_mean(info.rotation, info.branch == branch("rotate")),
      "shrinkage_mean": masked_mean(info.shrinkage, info.branch == branch("shrink")),
      "relative_correction": info.total_relative_correction,
      "weight": weight})
  return row


def to_host(rows: list[Row]) -> list[Row]:
  """``rows`` with their device scalars as Python numbers, in one device-to-host transfer."""
  fetched = jax.device_get(rows)
  return [{k: v.item() if isinstance(v, (np.ndarray, np.generic)) else v for k, v in row.items()}
          for row in fetched]


def jit_outer_step(tx: optax.GradientTransformationExtraArgs) -> Callable[..., Any]:
  """``(θ, state, Δ, τ) -> (θ', state')``: one update of ``tx``, jitted, θ and state donated."""
  def step(params, state, delta, staleness):
    updates, state = tx.update(delta, state, params, staleness=staleness)
    return optax.apply_updates(params, updates), state
  return jax.jit(step, donate_argnums=(0, 1))


def lookahead_default(config: ml_collections.ConfigDict) -> bool:
  """Whether ``config``'s method dispatches from the look-ahead point."""
  if config.lookahead_dispatch < 0:
    return METHODS[config.method].lookahead_dispatch
  return bool(config.lookahead_dispatch)


class OuterServer:
  """θ, the outer state and the outer rule of ``config.method``.

  Args:
    config: the run's config (method, outer.*, num_workers, lookahead_dispatch).
    params: the initial θ (copied: the outer step donates the server's buffers).
    place: puts a pytree where the server computes (default: leaves it).
  """

  def __init__(self, config: ml_collections.ConfigDict, params: Any,
               place: Callable[[Any], Any] = lambda tree: tree):
    self.config = config
    self._place = place
    method = METHODS[config.method]
    self.outer_tx = method.make_outer(config) if method.make_outer else None
    self.outer_state = place(self.outer_tx.init(params)) if self.outer_tx else None
    self.params = place(jax.tree.map(jnp.array, params))
    self.lookahead = lookahead_default(config)
    self._step = jit_outer_step(self.outer_tx) if self.outer_tx else None

  def get(self) -> tuple[Any, Any]:
    """(θ, outer state) on the host."""
    return jax.device_get((self.params, self.outer_state))

  def set(self, params: Any, outer_state: Any) -> None:
    """Replaces θ and the outer state (a restored checkpoint)."""
    self.params, self.outer_state = self._place(params), self._place(outer_state)

  def dispatch_point(self) -> Any:
    """Where a dispatched worker starts: θ, or θ − η·μ·m (look-ahead dispatch).

    New arrays, which later updates (they donate θ) leave intact: the
    simulated runtime runs a worker's steps when its arrival comes up.
    """
    if self.lookahead:
      return outer.lookahead_params(self.params, self.outer_state)
    return jax.tree.map(jnp.copy, self.params)

  def apply(self, delta: Any, staleness: int) -> None:
    """One outer update with pseudo-gradient ``delta`` of staleness τ."""
    self.params, self.outer_state = self._step(self.params, self.outer_state, delta,
                                               jnp.int32(staleness))

  def update(self, taus: list[int], poisons: list[Optional[str]], *deltas: Any,
             fetch: bool = True) -> list[Row]:
    """One arrival group: at most one outer update (scheduler docstring, "async").

    The only host read is the group's finiteness flags, which decide whether
    the update happens; with ``fetch=False`` the diagnostics stay device
    scalars, for the caller to fetch in batches with ``to_host``.

    Args:
      taus: each arrival's staleness τ.
      poisons: per arrival, None or "nan"/"inf" (fault injection, tests).
      *deltas: the arrivals' pseudo-gradients.
      fetch: return the diagnostics as Python numbers (default).

    Returns:
      Per arrival, ``{"reason": None | "nan" | "inf"}`` plus, when applied,
      its arrival-row diagnostics: ``cosine_mean`` (cos(Δ, m) with the
      momentum it meets) and, for HeLoCo, its block summary after the update.
      The update happens iff some reason is None.
    """
    deltas = [d if p is None else poison(d, p) for d, p in zip(deltas, poisons)]
    flags = jax.device_get([nonfinite(d) for d in deltas])  # the group's one host read
    results = [{"reason": reasons(*f)[0]} for f in flags]
    applied = [i for i, result in enumerate(results) if result["reason"] is None]
    if not applied:
      return results
    if self.config.method != "heloco":  # HeLoCo logs its own cosines, per block
      momentum = outer.outer_momentum(self.outer_state)
      for i in applied:
        results[i]["cosine_mean"] = alignment(deltas[i], momentum)
    taus_applied = [taus[i] for i in applied]
    if len(applied) == 1:
      self.apply(deltas[applied[0]], taus_applied[0])
    else:
      self.apply(self._combine([deltas[i] for i in applied], taus_applied), max(taus_applied))
    if self.config.method == "heloco":
      diagnostics = heloco_diagnostics(self.outer_state.info, self.outer_state.weight)
      for i in applied:
        results[i].update(diagnostics)
    return to_host(results) if fetch else results

  def _combine(self, deltas: list[Any], taus: list[int]) -> Any:
    """Grace window: Δ with ρ(τ_max)·Δ = mean_j ρ(τ_j)·Δ_j (scheduler docstring)."""
    weight = lambda tau: float(outer.arrival_weight(
        tau, num_workers=self.config.num_workers, weighting=self.config.outer.weighting))
    scales = [weight(tau) / weight(max(taus)) / len(deltas) for tau in taus]
    return jax.tree.map(lambda *xs: sum(s * x for s, x in zip(scales, xs)), *deltas)
