"""The server side of every runtime: θ, the outer state and the jitted outer rule.

``OuterServer`` holds θ and the state of any optax outer transform (a
registry method's, or a user's chain). It gives the dispatch point (θ, or
the look-ahead point θ − η·μ·m, docs/ALGORITHMS.md "MLA"), and applies one
``update`` per arrival group: it rejects non-finite pseudo-gradients
(``heloco_jax.training.rejection``), measures cos(Δ, m) with the momentum the
arrival meets, combines a grace window's arrivals and applies the rule.
HeLoCo's diagnostics come from the HeLoCo state wherever it sits in the chain
(``hj.heloco_diagnostics(state, per_block=False)``); the sub-states the server
reads are found inside the compiled programs that read them, when they are traced.

For a loop of your own, ``dispatch(worker)`` and ``arrive(delta, worker)`` do
the version and staleness bookkeeping::

  server = hj.Server(hj.heloco(0.7, 0.9, num_workers=2), params, lookahead=True)
  start = server.dispatch(worker=0)            # θ − η·μ·m
  ...                                          # H local steps from start
  row = server.arrive(start_minus_end, worker=0)  # {"staleness": τ, "applied": True, ...}

The engine (``heloco_jax.runtime.engine``) runs it in its own process for the
simulated and devices runtimes and as the parameter-server actor on Ray.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Optional, Sequence, get_args

import jax
import jax.numpy as jnp
import numpy as np
import optax

from heloco_jax import outer
from heloco_jax.training import aggregate as aggregate_lib
from heloco_jax.outer.heloco import merge_order_of
from heloco_jax.outer import lookahead as lookahead_lib
from heloco_jax.outer import packing
from heloco_jax.outer import weighting as weighting_lib
from heloco_jax.training import rejection, sharding

Row = dict[str, Any]


@jax.jit
def alignment(delta: Any, momentum: Any) -> jax.Array:
  """Mean over leaves of cos(Δ_leaf, m_leaf); a leaf with Δ or m zero counts 0. Δ and m
  packed (``packing.Packed``): from ``packing.leaf_sums``."""
  if isinstance(momentum, packing.Packed):
    sums = packing.leaf_sums(delta, momentum, lambda d: d.astype(jnp.float32))
    norms = jnp.sqrt(sums[:, 1]) * jnp.sqrt(sums[:, 2])
    return jnp.mean(jnp.where(norms > 0, sums[:, 0] / jnp.where(norms > 0, norms, 1.0), 0.0))
  cosines = []
  for d, m in zip(jax.tree.leaves(delta), jax.tree.leaves(momentum)):
    d, m = d.astype(jnp.float32).ravel(), m.astype(jnp.float32).ravel()
    norms = jnp.linalg.norm(d) * jnp.linalg.norm(m)
    cosines.append(jnp.where(norms > 0, jnp.dot(d, m) / jnp.where(norms > 0, norms, 1.0), 0.0))
  return jnp.mean(jnp.stack(cosines))


@jax.jit
def heloco_row(heloco_state: outer.HeLoCoState) -> dict[str, jax.Array]:
  """HeLoCo's arrival-row diagnostics (``hj.heloco_diagnostics(per_block=False)``), as
  device scalars.

  Fresh buffers, so they outlive the next outer step (which donates the
  state holding them) and can be fetched later, in a batch (``to_host``). The
  staleness is left out: a grace group's state holds τ_max, and each
  arrival's row already has its own τ.
  """
  row = outer.heloco_diagnostics(heloco_state, per_block=False)
  del row["staleness"]
  return row


def to_host(rows: list[Row]) -> list[Row]:
  """``rows`` with their device scalars as Python numbers, in one device-to-host transfer."""
  fetched = jax.device_get(rows)
  return [{k: v.item() if isinstance(v, (np.ndarray, np.generic)) else v for k, v in row.items()}
          for row in fetched]


def _copy(tree: Any) -> Any:
  """New buffers with ``tree``'s values (the outer step donates the server's): one
  transfer call for the whole tree, no compiled program per leaf shape. Arrays of other
  processes' devices too (``jax.distributed``: copied where they are)."""
  if all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(tree)):
    return jax.device_put(tree, may_alias=False)
  return jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), tree)


def _reading(types: tuple[type, ...], fn: str, read: Callable[..., Any]) -> Callable[..., Any]:
  """``read(sub_state, *args)`` of the one sub-state of ``types`` in an outer state, jitted:
  the sub-state is found when the program is traced (once per state structure), not at
  every arrival."""
  return jax.jit(lambda state, *args: read(lookahead_lib.find_state(state, types, fn), *args))


# The look-ahead point θ − η·μ·m as two compiled programs per tree structure (η·μ·m, then
# θ − that), not two eager ops per leaf at every dispatch. Not one program: XLA would fuse
# the multiply and the subtract into an FMA, and the single rounding changes θ's last bits
# against the eager hj.lookahead_params (the README's example then ends at val loss 0.0020
# instead of 0.054); two programs round as the eager ops do, bit for bit.
_scaled_momentum = _reading(lookahead_lib.LOOKAHEAD_STATES, "lookahead_params",
                            lookahead_lib.scaled_momentum)
_subtract = jax.jit(lookahead_lib.subtract)
# cos(Δ, m) with the momentum an arrival meets, and HeLoCo's row: one program each.
_alignment = _reading(lookahead_lib.MOMENTUM_STATES, "outer_momentum",
                      lambda sub_state, delta: alignment(delta,
                                                         lookahead_lib.momentum_of(sub_state)))
_heloco_row = _reading((outer.HeLoCoState,), "heloco_diagnostics", heloco_row)
# A screen's (‖Δ‖, cos(Δ, m)) with the momentum an arrival meets (ALGORITHMS.md, "Aggregation").
_norm_and_cosine = _reading(lookahead_lib.MOMENTUM_STATES, "outer_momentum",
                            lambda sub_state, delta: aggregate_lib.norm_and_cosine(
                                delta, lookahead_lib.momentum_of(sub_state)))
_stack_scaled = jax.jit(lambda deltas, scales: jax.tree.map(
    lambda *xs: jnp.stack([(s * x).astype(x.dtype) for s, x in zip(scales, xs)]), *deltas))
_stack = jax.jit(lambda deltas: jax.tree.map(lambda *xs: jnp.stack(xs), *deltas))
_pack = jax.jit(packing.pack)
_unpack = jax.jit(packing.unpack)
_unpack_all = jax.jit(packing.unpack_all)


def _identity(tree: Any) -> Any:
  return tree


def jit_outer_step(tx: optax.GradientTransformationExtraArgs,
                   constrain: Callable[[Any], Any] = _identity) -> Callable[..., Any]:
  """``(θ, state, Δ, τ) -> (θ', state')``: one update of ``tx``, jitted, θ and state donated
  (trees, or all three packed: ``packing.Packed``); ``constrain`` pins the outputs' layout
  (``heloco_jax.training.sharding.Layout.constrain``)."""
  tx = optax.with_extra_args_support(tx)
  def step(params, state, delta, staleness):
    updates, state = tx.update(delta, state, params, staleness=staleness)
    return constrain((optax.apply_updates(params, updates), state))
  return jax.jit(step, donate_argnums=(0, 1))


def jit_group_step(tx: optax.GradientTransformationExtraArgs,
                   constrain: Callable[[Any], Any] = _identity) -> Callable[..., Any]:
  """``(θ, state, Δs, τs, w) -> (θ', state')``: one update of ``tx`` for a group of arrivals
  stacked on axis 0 (``update``'s ``group_weights``: ``hj.heloco``'s merge order), jitted, θ
  and state donated."""
  tx = optax.with_extra_args_support(tx)
  def step(params, state, deltas, staleness, weights):
    updates, state = tx.update(deltas, state, params, staleness=staleness,
                               group_weights=weights)
    return constrain((optax.apply_updates(params, updates), state))
  return jax.jit(step, donate_argnums=(0, 1))


def _heloco_states(state: Any) -> list[outer.HeLoCoState]:
  return [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, outer.HeLoCoState))
          if isinstance(x, outer.HeLoCoState)]


def corrects_then_merges(state: Any) -> bool:
  """Whether an outer state holds an ``hj.heloco(merge_order="correct_then_merge")``."""
  return any(merge_order_of(x) == "correct_then_merge"
             for x in _heloco_states(state))


def check_merge_order(outer_tx: Optional[optax.GradientTransformation], params: Any,
                      groups: bool) -> None:
  """Refuses ``merge_order="correct_then_merge"`` where no group is ever merged (one line).

  Args:
    outer_tx: the run's outer rule (its state is built abstractly: nothing is computed).
    params: θ.
    groups: whether the run merges arrivals (``hj.Syncer.groups``).
  """
  if outer_tx is None or groups:
    return
  if corrects_then_merges(jax.eval_shape(outer_tx.init, params)):
    raise ValueError("merge_order='correct_then_merge' is not allowed without groups of "
                     "arrivals; allowed: 'merge_then_correct' (the default), or a syncer that "
                     "merges arrivals (hj.Syncer(quorum > 1) or a grace window)")


OuterLayout = Literal["auto", "tree", "packed"]
OUTER_LAYOUTS: tuple[str, ...] = get_args(OuterLayout)


def packs_outer(outer_layout: OuterLayout, *, rule: bool, user_rule: bool, sharded: bool,
                platform: Optional[str] = None) -> bool:
  """Whether the server holds θ and the outer state packed (``OuterServer``'s ``packed``).

  "auto" packs a registry rule (``user_rule`` False; a user's chain may read the tree's
  structure: ``optax.masked``, per-leaf norms) on an accelerator (``platform``: the
  default backend's), where an outer step over a tree of many leaves is launch-bound; on
  a CPU packing Δ costs more than it saves on large trees (docs/BENCHMARKS.md), and the
  tree keeps today's bits. Never with θ
  sharded (packing would gather θ) or without an outer rule (DDP).

  Raises:
    ValueError: an ``outer_layout`` that is not allowed, or "packed" with θ sharded.
  """
  if outer_layout not in OUTER_LAYOUTS:
    raise ValueError(f"outer_layout={outer_layout!r} is not allowed; allowed: one of "
                     f"{list(OUTER_LAYOUTS)}")
  if outer_layout == "packed" and sharded:
    raise ValueError("outer_layout='packed' is not allowed with θ sharded; allowed: 'tree' or "
                     "'auto' (packing would gather θ onto one device)")
  if not rule or outer_layout == "tree":
    return False
  if outer_layout == "packed":
    return True
  return not user_rule and not sharded and (platform or jax.default_backend()) != "cpu"


class OuterServer:
  """θ, the outer state and an outer rule.

  Args:
    outer_tx: any optax transform of pseudo-gradients (``hj.heloco(...)``, a
      chain holding one, ``optax.sgd(...)``); its ``update`` receives the
      keyword ``staleness``. None: θ changes only through ``params``
      (DDP).
    params: the initial θ (copied: the outer step donates the server's buffers).
    lookahead: dispatch from θ − η·μ·m (needs an MLA or HeLoCo state in the chain).
    place: puts a pytree where the server computes (default: leaves it).
    layout: θ's ``heloco_jax.training.sharding.Layout`` when θ is sharded: θ, the outer
      state and the outer step keep it (and ``place`` should put trees there).
    packed: hold θ and the outer state packed, one buffer per dtype (``packing.Packed``;
      docs/ALGORITHMS.md, "Packed outer state"): the outer step runs a few passes instead of
      a few per leaf, equal to the tree's within float32 rounding. Only for a rule whose
      state is elementwise or reads leaves through ``packing`` (every registry rule); not
      with θ sharded. ``params``, ``outer_state``, ``get`` and ``set`` stay trees.
    aggregate: how a group's accepted arrivals merge, or each arrival is screened
      (``hj.aggregate``; default ``mean()``, today's).
    park: puts a dispatch point where dispatched workers wait with it (default: leaves it;
      ``hj.simulated_runtime(pending_memory="pinned_host")``: host memory).
  """

  def __init__(self, outer_tx: Optional[optax.GradientTransformation], params: Any, *,
               lookahead: bool = False,
               place: Callable[[Any], Any] = _identity,
               layout: Optional[sharding.Layout] = None,
               packed: bool = False,
               aggregate: aggregate_lib.Aggregate = aggregate_lib.Mean(),
               park: Callable[[Any], Any] = _identity):
    if packed and (layout is not None or outer_tx is None):
      raise ValueError("packed=True is not allowed "
                       + ("with θ sharded" if layout is not None else "without an outer rule")
                       + "; allowed: an outer rule on an unsharded θ (packing would gather θ)")
    self._place = place
    self.layout = layout
    self.outer_tx = outer_tx
    self.packed = packed
    self._like = jax.eval_shape(lambda tree: tree, params)  # θ's structure, shapes and dtypes
    constrain = layout.constrain if layout is not None else _identity
    self._params = place(_pack(params) if packed else _copy(params))
    # One compiled program (not one small eager op per leaf): start-up time. From the placed
    # θ: across processes the user's θ may sit on other devices than the server's.
    self._state = (place(jax.jit(lambda p: constrain(outer_tx.init(p)))(self._params))
                   if outer_tx is not None else None)
    self.lookahead = lookahead
    self._point: Optional[tuple[Any, Any, Any]] = None  # (θ, state, their dispatch point)
    self._park = park
    holds = lookahead_lib.holds_one
    if lookahead and not holds(self._state, lookahead_lib.LOOKAHEAD_STATES):
      raise ValueError("lookahead=True needs an hj.mla or hj.heloco state in outer_tx's state "
                       "(the look-ahead point θ − η·μ·m reads its η, μ and m)")
    # ρ(τ) as the rule defines it (its states' ``ArrivalWeighting``s), for a grace window.
    self._arrival_weight = weighting_lib.arrival_weighting(self._state)
    self._step = jit_outer_step(outer_tx, constrain) if outer_tx is not None else None
    # HeLoCo logs its own cosines, per block; another rule with a momentum, cos(Δ, m).
    self._heloco = holds(self._state, (outer.HeLoCoState,))
    self._aligns = not self._heloco and holds(self._state, lookahead_lib.MOMENTUM_STATES)
    self.version = 0
    self._dispatched: dict[int, int] = {}
    self.aggregate = aggregate
    self._screen = isinstance(aggregate, aggregate_lib.Screen)
    if self._screen and aggregate.cosine is not None and not holds(
        self._state, lookahead_lib.MOMENTUM_STATES):
      raise ValueError(f"aggregate={aggregate!r} is not allowed with this outer rule; allowed: "
                       "cosine=None (the cosine screen reads an outer momentum)")
    self.accepted_norms: list[float] = []  # a screen's history (its last ``window``)
    # hj.heloco(merge_order="correct_then_merge"): a group goes to the rule whole, stacked
    # (ALGORITHMS.md, "Merge order under a quorum"); the rule must see it as it is.
    self._group_step = None
    if corrects_then_merges(self._state):
      inner_state = getattr(self._state, "inner_state", self._state)  # inject_hyperparams
      if not isinstance(inner_state, outer.HeLoCoState):
        raise ValueError("merge_order='correct_then_merge' is not allowed inside a chain; "
                         "allowed: hj.heloco(...) itself as the outer rule (a chain's other "
                         "transforms would see a group's arrivals stacked)")
      if not isinstance(aggregate, aggregate_lib.Mean):
        raise ValueError(f"merge_order='correct_then_merge' is not allowed with aggregate="
                         f"{aggregate!r}; allowed: hj.aggregate.mean() (the corrected "
                         "arrivals merge with the syncer's weights)")
      self._group_step = jit_group_step(outer_tx, constrain)

  @property
  def params(self) -> Any:
    """θ (a tree; new arrays when packed)."""
    return _unpack(self._params) if self.packed else self._params

  @params.setter
  def params(self, params: Any) -> None:
    self._params = self._place(_pack(params)) if self.packed else params

  @property
  def outer_state(self) -> Any:
    """The outer state (its momentum a tree like θ; new arrays when packed)."""
    return _unpack_all(self._state) if self.packed else self._state

  def get(self) -> tuple[Any, Any]:
    """(θ, outer state) on the host; sharded, where they are (a checkpoint writes them shard
    by shard)."""
    if self.layout is not None:
      return self.params, self.outer_state
    return jax.device_get((self.params, self.outer_state))

  def set(self, params: Any, outer_state: Any) -> None:
    """Replaces θ and the outer state (a restored checkpoint; trees, packed here if packed)."""
    if self.packed:
      like = self._state
      outer_state = jax.jit(lambda tree: packing.pack_like(tree, like))(outer_state)
      params = _pack(params)
    self._params, self._state = self._place(params), self._place(outer_state)

  def dispatch_point(self) -> Any:
    """Where a dispatched worker starts: θ, or θ − η·μ·m (look-ahead dispatch).

    New arrays, which later updates (they donate θ) leave intact: the
    simulated runtime runs a worker's steps when its arrival comes up. Workers
    dispatched between two updates share them (docs/DESIGN.md, "Memory per worker").
    """
    made = self._point
    if made is None or made[0] is not self._params or made[1] is not self._state:
      if self.lookahead:
        point = _subtract(self._params, _scaled_momentum(self._state))
        point = _unpack(point) if self.packed else point
      else:
        point = self.params if self.packed else _copy(self._params)
      self._point = made = (self._params, self._state, self._park(point))
    return made[2]

  def apply(self, delta: Any, staleness: int) -> None:
    """One outer update with pseudo-gradient ``delta`` (a tree like θ) of staleness τ."""
    self._apply(_pack(delta) if self.packed else delta, staleness)

  def _apply(self, delta: Any, staleness: int) -> None:
    """``apply`` of a Δ already in the server's layout (packed when ``packed``)."""
    self._params, self._state = self._step(self._params, self._state, delta,
                                           jnp.int32(staleness))

  def update(self, taus: list[int], *deltas: Any, fetch: bool = True,
             weights: Optional[list[float]] = None) -> list[Row]:
    """One arrival group: at most one outer update.

    The only host read is the group's finiteness flags, which decide whether
    the update happens; with ``fetch=False`` the diagnostics stay device
    scalars, for the caller to fetch in batches with ``to_host``.

    Args:
      taus: each arrival's staleness τ.
      *deltas: the arrivals' pseudo-gradients.
      fetch: return the diagnostics as Python numbers (default).
      weights: per arrival, ω_j of the merge (``heloco_jax.comm.syncer.Syncer.merge_weights``);
        None: 1 each (the mean).

    Returns:
      Per arrival, ``{"reason": None | "nan" | "inf"}`` plus, when applied,
      its diagnostics: ``cosine_mean`` (cos(Δ, m) with the momentum it
      meets) and, when the chain holds HeLoCo, its block summary after the
      update. The update happens iff some reason is None; several applied
      arrivals are combined as Δ with ρ(τ_max)·Δ = Σ_j ω_j·ρ(τ_j)·Δ_j / |G| (then corrected
      once, for HeLoCo), or, with ``hj.heloco(merge_order="correct_then_merge")``, given to
      the rule stacked, with weights ω_j/|G|.
    """
    results = [{"reason": reason} for reason in rejection.screen(deltas)]
    applied = [i for i, result in enumerate(results) if result["reason"] is None]
    if not applied:
      return results
    if self.packed:  # once: the cosine check, a group's mean and the step read the buffers
      deltas = tuple(_pack(d) if i in applied else d for i, d in enumerate(deltas))
    if self._screen:
      deltas, applied = self._screened(deltas, applied, results)
      if not applied:
        return results
    if self._aligns:
      for i in applied:
        results[i]["cosine_mean"] = _alignment(self._state, deltas[i])
    taus_applied = [taus[i] for i in applied]
    if len(applied) == 1:
      self._apply(deltas[applied[0]], taus_applied[0])
    elif self._group_step is not None:  # correct-then-merge: the rule takes the group whole
      omegas = [1.0 if weights is None else weights[i] for i in applied]
      self._params, self._state = self._group_step(
          self._params, self._state, _stack([deltas[i] for i in applied]),
          jnp.asarray(taus_applied, jnp.int32),
          jnp.asarray([omega / len(applied) for omega in omegas], jnp.float32))
    else:
      omegas = [1.0 if weights is None else weights[i] for i in applied]
      self._apply(self._combine([deltas[i] for i in applied], taus_applied, omegas),
                 max(taus_applied))
    self.version += 1
    if self._heloco:
      diagnostics = _heloco_row(self._state)
      for i in applied:
        results[i].update(diagnostics)
    return to_host(results) if fetch else results

  def _combine(self, deltas: list[Any], taus: list[int], omegas: list[float]) -> Any:
    """A group: Δ with ρ(τ_max)·Δ = Σ_j ω_j·ρ(τ_j)·Δ_j / |G| (ω_j = 1: the mean); a peer rule
    (``hj.aggregate``) over ρ(τ_j)/ρ(τ_max)·Δ_j with weights ω_j/|G| instead."""
    weight = self._arrival_weight
    if self.aggregate.peers:
      scales = [weight(tau) / weight(max(taus)) for tau in taus]
      weights = jnp.asarray([omega / len(deltas) for omega in omegas], jnp.float32)
      return aggregate_lib.combine(self.aggregate, _stack_scaled(deltas, scales), weights)
    scales = [weight(tau) / weight(max(taus)) * omega / len(deltas)
              for tau, omega in zip(taus, omegas)]
    return aggregate_lib.weighted_sum(deltas, scales)

  def _screened(self, deltas: tuple[Any, ...], applied: list[int], results: list[Row]
                ) -> tuple[tuple[Any, ...], list[int]]:
    """A screen (``hj.aggregate.screen``) of each finite arrival against the norms accepted
    before it and its cosine with the momentum (one host read per arrival): a rejected one's
    reason set ("norm", "cosine"), a clipped one scaled."""
    rule, kept, deltas = self.aggregate, [], list(deltas)
    for i in applied:
      if rule.cosine is not None:
        norm, cosine = (float(x) for x in jax.device_get(_norm_and_cosine(self._state,
                                                                            deltas[i])))
        cosine = cosine if np.isfinite(cosine) and cosine != 0.0 else None
      else:
        norm, cosine = float(aggregate_lib.global_norm(deltas[i])), None
      reason, factor = rule.verdict(norm, cosine, self.accepted_norms)
      if reason is not None:
        results[i]["reason"] = reason
        continue
      if factor != 1.0:
        deltas[i] = aggregate_lib.scaled(deltas[i], jnp.float32(factor))
        results[i]["clipped"] = factor
      self.accepted_norms = (self.accepted_norms + [norm * factor])[-rule.window:]
      kept.append(i)
    return tuple(deltas), kept

  def history(self) -> list[float]:
    """A screen's history (``hj.aggregate.screen``: the last ``window`` accepted norms), which
    a checkpoint keeps (``set_history``) so that a resumed run screens as it would have."""
    return list(self.accepted_norms)

  def set_history(self, norms: Sequence[float]) -> None:
    self.accepted_norms = [float(x) for x in norms]

  # ------------------------------------------------ a loop of your own

  def dispatch(self, worker: int = 0) -> Any:
    """The start point for ``worker``; remembers the version it starts from. Workers
    dispatched at the same θ get the same arrays: a step that donates its input copies it
    first."""
    self._dispatched[worker] = self.version
    return self.dispatch_point()

  def arrive(self, delta: Any, worker: int = 0) -> Row:
    """``worker``'s pseudo-gradient Δ = start − end arrives: one outer update.

    Returns:
      ``{"worker", "staleness", "applied", "reason", "version", ...}`` with
      the diagnostics of ``update`` as Python numbers; a non-finite Δ is
      rejected (``applied`` False, θ unchanged).

    Raises:
      KeyError: ``worker`` was not dispatched.
      ValueError: ``delta`` has another structure or other shapes than θ (the message
        names the leaf).
    """
    if worker not in self._dispatched:
      raise KeyError(f"arrive(worker={worker}): that worker was not dispatched; call "
                     "dispatch(worker) first")
    _check_like(delta, self._like, f"arrive(worker={worker})")
    tau = self.version - self._dispatched.pop(worker)
    result = self.update([tau], delta)[0]
    reason = result.pop("reason")
    return {"worker": worker, "staleness": tau, "applied": reason is None, "reason": reason,
            "version": self.version, **result}


class FragmentServers:
  """θ in P fragments, each with its own outer state and rule (ALGORITHMS.md, "Fragments").

  Fragment p's server is an ``OuterServer`` over ``fragments.take(θ, p)``: its
  outer state (the momentum HeLoCo checks against, MLA's look-ahead) holds the
  fragment's leaves only, and its cosine check, correction and weights see
  that fragment alone.

  Args:
    make_server: ``(outer_tx, params, lookahead=...) -> OuterServer`` (the executor's).
    outer_tx: the outer rule, one copy per fragment.
    params: the initial θ.
    fragments: the split (``heloco_jax.comm.fragments.Fragments``).
    lookahead: each fragment dispatches from its own θ_p − η·μ·m_p.
    fetch: a fragment server's dispatch point as values (the executor's ``fetch``; on Ray
      the servers are actors that return handles).
  """

  def __init__(self, make_server: Callable[..., OuterServer], outer_tx: Any, params: Any,
               fragments: Any, *, lookahead: bool = False,
               fetch: Callable[[Any], Any] = lambda point: point):
    self.fragments = fragments
    self._fetch = fetch
    self.servers = [make_server(outer_tx, fragments.take(params, p), lookahead=lookahead)
                    for p in range(fragments.num)]

  @property
  def layout(self) -> Optional[sharding.Layout]:
    """θ's layout (every fragment's server holds its leaves of θ with θ's specs)."""
    return self.servers[0].layout

  @property
  def params(self) -> Any:
    return self.fragments.merge([server.params for server in self.servers])

  @property
  def outer_state(self) -> list[Any]:
    return [server.outer_state for server in self.servers]

  def get(self) -> tuple[Any, list[Any]]:
    """(θ, the fragments' outer states) on the host."""
    parts = [server.get() for server in self.servers]
    return self.fragments.merge([params for params, _ in parts]), [state for _, state in parts]

  def set(self, params: Any, outer_state: list[Any]) -> None:
    for p, server in enumerate(self.servers):
      server.set(self.fragments.take(params, p), outer_state[p])

  def history(self) -> list[list[float]]:
    """Each fragment's server's ``history``."""
    return [server.history() for server in self.servers]

  def set_history(self, norms: Sequence[Sequence[float]]) -> None:
    for server, history in zip(self.servers, norms, strict=True):
      server.set_history(history)

  def dispatch_point(self) -> Any:
    """θ's dispatch point, fragment by fragment."""
    return self.fragments.merge([self.fragment_point(p) for p in range(self.fragments.num)])

  def fragment_point(self, p: int) -> Any:
    """Fragment ``p``'s dispatch point (a ``fragments.take`` of θ's)."""
    return self._fetch(self.servers[p].dispatch_point())

  def fragment(self, p: int) -> OuterServer:
    return self.servers[p]


def _check_like(delta: Any, params: Any, where: str) -> None:
  """``delta`` has θ's tree structure and leaf shapes, or a ValueError naming the leaf."""
  if jax.tree.structure(delta) != jax.tree.structure(params):
    raise ValueError(f"{where}: the pseudo-gradient's structure {jax.tree.structure(delta)} is "
                     f"not θ's; allowed: a tree like θ, {jax.tree.structure(params)}")
  for (path, d), p in zip(jax.tree_util.tree_leaves_with_path(delta), jax.tree.leaves(params)):
    if np.shape(d) != np.shape(p):
      raise ValueError(f"{where}: the pseudo-gradient's leaf "
                       f"{jax.tree_util.keystr(path, simple=True, separator='/')!r} has shape "
                       f"{tuple(np.shape(d))}; allowed: θ's, {tuple(np.shape(p))}")


Server = OuterServer
