"""The engine's three loops, one per synchrony of the registry (``Method.synchrony``).

Each loop is an asynchronous generator over a ``state.Run`` that yields after
every outer update (an arrival group, a round, a chunk of DDP steps); the
engine (``runtime.engine``) evaluates, checkpoints and hands the event loop
on at each yield, in one place.

  * ``run_async``: one outer update per arrival with staleness τ = v − s; the
    worker is re-dispatched at once from the server's dispatch point.
    The syncer (``heloco_jax.comm.syncer``: quorum, grace window, token weights)
    may group arrivals into one update (``OuterServer.update``). A failure
    schedule (``heloco_jax.training.membership``) takes workers away and brings them
    back through the same queue (``runtime.elastic``, the component the loops
    call). On the simulated clock a dispatch fixes its inputs (start point,
    batches, PRNG key) and its steps are computed lazily:
    when its job reaches the head of the arrival queue (so the device works on
    the next arrival while the host handles this one) or when a checkpoint
    needs it; work a budget discards is never computed. The results are those
    of computing at dispatch, bit for bit.
  * ``run_rounds``: all workers start from θ, run H steps (``vmap``),
    Δ = mean Δ_i, one outer update. PALSGD's rounds pull toward θ̃ = θ and
    keep the inner optimizer states; its DDP warm-up comes first.
  * ``run_ddp``: every step averages the K workers' gradients, which is one
    inner step on their K batches together.
"""

from __future__ import annotations

import functools
import math
from typing import Any, AsyncIterator, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from heloco_jax.training import aggregate as aggregate_lib
from heloco_jax.comm import fragments as fragments_lib
from heloco_jax.runtime import base, clocks, elastic as elastic_lib, streaming
from heloco_jax.runtime.base import Job
from heloco_jax.runtime.state import Run
from heloco_jax.training import inner as inner_lib
from heloco_jax.training import rejection


@functools.partial(jax.jit, static_argnums=1)
def _stack_copies(tree, k: int):
  """``k`` copies of ``tree`` stacked on a new leading axis (one compiled program)."""
  return jax.tree.map(lambda x: jnp.stack([x] * k), tree)


def _emit_train(run: Run, loss, **fields: int) -> None:
  """The ``train`` row of a round or a DDP chunk: its steps' mean training loss and the
  bytes its workers sent and received (and a round's fragment)."""
  s = run.state
  run.emit({"event": "train", run.spec.unit: s.units, "sim_time": s.sim_time,
            "outer_updates": s.version, **fields, **run.train_loss(loss)})


def steps_per_dispatch(spec) -> np.ndarray:
  """H for every worker, or DyLU's H_i = max(1, ⌊v_i/v_ref·H⌋) (ALGORITHMS.md, "DyLU")."""
  if spec.dylu:
    return clocks.dylu_steps(np.asarray(spec.seconds_per_step, float), spec.inner_steps)
  return np.full(spec.num_workers, spec.inner_steps)


async def run_async(run: Run) -> AsyncIterator[None]:
  """Asynchronous arrivals until the queue is empty or a budget ends."""
  s, spec, clock = run.state, run.spec, run.clock
  f = run.features
  steps = steps_per_dispatch(spec)
  queue = run.arrivals()

  def dispatch(worker: int, now: float) -> None:
    if elastic and elastic.away_at_dispatch(worker, now):  # its return is queued instead
      return
    if fragments:
      s.jobs[worker] = streaming.dispatch_fragment(run, worker, now)
    else:
      previous, down = s.workers[worker], None
      if carried:
        previous = run.model_states.for_dispatch(worker, previous)
      if downlink is None:
        start = run.server.dispatch_point()
      else:  # ALGORITHMS.md, "Compressed downloads"
        start = f.downlink.send(downlink, worker, run.server.dispatch_point)
        down = f.downlink.bytes_down[worker]
      work = functools.partial(  # the end state kept as its carry (DESIGN.md, "Memory per worker")
          run.executor.run_worker, worker, previous, start,
          run.batches(worker, int(steps[worker])), run.next_key(), carry=True)
      finish = clock.finish(worker, int(steps[worker]), now, down)
      s.jobs[worker] = Job(None, s.version, int(steps[worker]) * spec.units_per_step,
                           finish, work)
    f.membership.dispatched_units += s.jobs[worker].units
    leave = elastic.next_leave(worker, now) if elastic else math.inf
    if elastic and leave < s.jobs[worker].finish:  # it leaves first: lost, never computed
      elastic.lost_to_leave(worker, leave)
      return
    if clock.eager:
      run.compute(worker)
    queue.push(worker, s.jobs[worker], leave)

  # A feature that is off is not called on the arrival path (docs/DESIGN.md, "The engine").
  fragments, carried = spec.streaming, run.model_states.active
  downlink = None if fragments else run.downlink  # (fragments: x̂ is the anchor, streaming.py)
  adaptive = spec.syncer.adaptive_grace > 0  # else every group has the same rule
  rule = spec.syncer.rule(None)
  elastic = (elastic_lib.AsyncMembership(run, queue, dispatch) if spec.membership.absences
             else None)
  for worker in sorted(s.jobs, key=lambda w: (s.jobs[w].finish, w)):  # restored jobs
    if fragments:
      s.jobs[worker].fragment = f.streaming.syncs[worker] % spec.fragments
    queue.push(worker, s.jobs[worker],  # (a simulated queue ignores the leave)
               elastic.leaves(worker) if elastic else math.inf)
  if elastic:
    elastic.restore()
  if s.phase is None:
    s.phase, s.workers = "async", [None] * spec.num_workers
    f.compression.states = run.uplink.init(run.server.params, spec.num_workers, stacked=False)
    if downlink is not None:
      f.downlink.start(run.server.params, spec.num_workers)
    if fragments:
      f.streaming.start(spec.fragments, spec.num_workers)
    for worker in range(spec.num_workers):
      dispatch(worker, 0.0)
  try:
    while len(queue):
      if adaptive:
        rule = spec.syncer.rule(f.syncer.mean_gap)
      now, group, times = await queue.pop(rule, elastic.events if elastic else None)
      if elastic and group[0] in elastic.away:  # a membership event at the queue's head
        if spec.budget.over(s.units, now):
          break
        s.sim_time = now
        elastic.event(group[0], now)
        continue
      if elastic and not clock.simulated:  # taken when they left (FAILURES.md): lost
        if spec.budget.over(s.units, now):
          break
        group, times = elastic.without_leavers(group, times)
        if not group:
          continue
      if adaptive:
        f.syncer.arrived(times)
      units = s.units + sum(s.jobs[w].units for w in group)
      if spec.budget.over(units, now):
        break  # this group and everything still in flight are discarded, never computed
      _apply_arrivals(run, group, units, now, fragments, carried)
      for w in group:
        dispatch(w, now)
      if not clock.eager:  # the next arrivals compute (on D devices, concurrently)
        _launch_ahead(run, queue)  # while the host goes on
      yield
  finally:
    queue.close()


def _apply_arrivals(run: Run, group: list[int], units: int, now: float, fragments: bool,
                    carried: bool) -> None:
  """One arrival group: at most one outer update, its rows, rejected workers reset. With
  ``fragments`` a group is one arrival, of one fragment, applied by its server; ``carried``:
  the workers' model state merges into the server's copy (``run.model_states``)."""
  s, spec = run.state, run.spec
  f = run.features
  for w in group:
    run.compute(w)
  arrived = [s.jobs.pop(w) for w in group]
  s.units, s.sim_time = units, now
  p = arrived[0].fragment
  server, version = ((run.server.fragment(p), f.streaming.fragment_versions[p])
                     if fragments else (run.server, s.version))
  taus = [version - job.version for job in arrived]
  # What each received at dispatch (None: θ whole), read before a rejection restarts it.
  received = [streaming.received(run, w) for w in group] if fragments else [None] * len(group)
  if run.downlink is not None and not fragments:  # each its dispatch's: θ's or a message's
    downs = [f.downlink.bytes_down[w] for w in group]
  else:  # θ whole, or the fragment received (its message when downloads are compressed)
    parts = run.uplink.bytes_down if run.downlink is None else run.downlink.fragment_bytes
    downs = [run.uplink.model_bytes if q is None else parts[q] for q in received]
  if fragments:
    network = run.clock.fragment_wait(group[0], received[0], p)
  else:
    network = _dispatch_seconds(run.clock, len(group),
                                downs if run.downlink is not None else None)
  weights = (spec.syncer.merge_weights([job.units for job in arrived]) if len(group) > 1
             else None)
  results = server.update(taus, *(job.delta for job in arrived), fetch=False, weights=weights)
  reasons = [result.pop("reason") for result in results]
  for w, tau, reason, job in zip(group, taus, reasons, arrived):
    if reason is None:
      if carried:
        run.model_states.arrive(s.workers[w])
    else:
      run.reject(w, reason, tau, job.units)
      s.workers[w] = run.executor.fresh_moments(s.workers[w])
      if fragments:  # it starts again from θ as a whole
        f.streaming.restart(w)
  if any(reason is None for reason in reasons):
    s.version += 1
    if fragments:
      f.streaming.fragment_versions[p] += 1
  up = run.uplink.bytes_up[p]
  f.traffic.sync(len(group) * up + sum(downs), network)
  for w, tau, reason, result, job, down in zip(group, taus, reasons, results, arrived, downs):
    if reason is None:
      s.staleness.append(tau)
      run.emit({"event": "arrival", "worker": w, "staleness": tau, spec.unit: s.units,
                "sim_time": now, "outer_updates": s.version, "fragment": p, "bytes_up": up,
                "bytes_down": down, **run.train_loss(job.train_loss), **result})
  f.rejection.update(reasons, group)


def _dispatch_seconds(clock: base.Clock, count: int,
                      downloads: Optional[list[int]] = None) -> Optional[float]:
  """``count`` workers' seconds on the network for a dispatch each (θ down, or each of
  ``downloads`` bytes when compressed; Δ up): the run's link, which either clock charges."""
  if downloads is None:
    return count * (clock.download + clock.upload)
  return sum(clock.comm.message_seconds(d) + clock.upload for d in downloads)


def _launch_ahead(run: Run, queue: base.Arrivals) -> None:
  """Starts the work of the next D arrivals (D = the executor's concurrency), in arrival
  order, unless the budget will discard it as things stand; JAX runs it asynchronously."""
  s, budget = run.state, run.spec.budget
  f = run.features
  units = s.units
  for worker in queue.heads(run.executor.concurrency):
    if worker in f.membership.away:  # a membership event: no work
      continue
    job = s.jobs[worker]
    units += job.units
    if budget.over(units, job.finish):
      return
    run.compute(worker)


async def run_rounds(run: Run) -> AsyncIterator[None]:
  """Synchronous rounds until a budget ends (PALSGD: after its DDP warm-up)."""
  s, spec, k, h = run.state, run.spec, run.spec.num_workers, run.spec.inner_steps
  f = run.features
  executor, inner = run.executor, run.executor.inner
  palsgd = spec.method.inner == "palsgd"
  if palsgd and s.phase in (None, "ddp"):
    warmup = h if spec.palsgd_warmup_steps is None else spec.palsgd_warmup_steps
    if warmup:
      async for _ in run_ddp(run, warmup):
        yield
      if spec.budget.over(s.units, s.sim_time):
        return
      # The first round continues the warm-up's step count and optimizer state.
      s.workers = run.model_states.keyed(_stack_copies(s.workers, k))
  if s.phase != "rounds":
    f.compression.states = run.uplink.init(executor.to_rounds(run.server.params), k, stacked=True)
  if spec.streaming:
    async for _ in _streaming_rounds(run):
      yield
    return
  s.phase = "rounds"
  membership = spec.membership
  while True:
    # Everyone away: the next round starts when one comes back.
    present = await elastic_lib.present(run)
    if present is None:
      return
    # The keys draw PALSGD's coins: one per round for all (shared) or one per worker.
    keys = jnp.stack([run.next_key()] * k if spec.palsgd_coins == "shared"
                     else [run.next_key() for _ in range(k)])
    # A round is checked against the budget before it is computed (its work would not be
    # applied): its steps, less PALSGD's pseudo-sync steps (which read no data and cost no
    # compute time), drawn ahead from its keys; on the simulated clock also its seconds.
    pseudo = inner_lib.pseudo_sync_steps(inner.tx, keys, h) if palsgd else np.zeros(k, int)
    start, ahead = s.sim_time, None
    if pseudo is not None:
      planned = np.where(present, h - pseudo, 0)
      if run.clock.simulated:
        ahead = run.clock.round_seconds(planned, start)
        part = present & ~membership.lost(present, start, start + ahead)
      else:  # the real clock's seconds are known after the round
        part = present
      if spec.budget.over(s.units + int(planned[part].sum()) * spec.units_per_step,
                          start + (ahead or 0.0)):
        return
    # Every worker restarts from θ, keeping its own step count (and its optimizer
    # state unless reset_optimizer).
    theta = executor.to_rounds(run.server.params)
    starts = inner.start_many(theta, run.model_states.for_round(s.workers), k)
    batches = jax.tree.map(lambda *xs: np.stack(xs), *[run.batches(i, h) for i in range(k)])
    states, metrics = executor.run_round(starts, batches, keys, theta if palsgd else None)
    real_steps = np.where(present, h - executor.to_host(metrics.pseudo_sync).sum(axis=1), 0)
    if pseudo is not None and not np.array_equal(real_steps, planned):
      raise RuntimeError(f"PALSGD's coins drawn ahead ({planned}) are not the round's "
                         f"({real_steps}): please report it")
    duration = run.clock.round_seconds(real_steps, start) if ahead is None else ahead
    # ALGORITHMS.md, "Elastic membership": a worker that leaves before the barrier loses its
    # part of the round; the others' parts are averaged.
    lost = membership.lost(present, start, start + duration)
    part = present & ~lost
    units = s.units + int(real_steps[part].sum()) * spec.units_per_step
    if spec.budget.over(units, start + duration):  # a real clock's seconds ran out during it
      return
    s.units, s.sim_time = units, start + duration
    accepted = _screen_round(run, states, real_steps, part)
    if not accepted.all():
      states = inner.reset_moments(states, executor.to_rounds(~accepted))
    if not part.all():  # the absent and the lost keep their state from before the round
      before = inner.start_many(executor.to_rounds(run.server.params),
                                run.model_states.for_round(s.workers), k)
      states, metrics = _where_part(run, part, states, before), _only_part(metrics, part)
    s.workers = states
    if f.compression.states is not None:  # every worker sends, and keeps its residual
      delta, residuals = executor.compressed_round_delta(
          run.uplink, run.server.params, states.params, accepted, f.compression.states[0])
      f.compression.states[0] = (residuals if part.all() else
                          _where_part(run, part, residuals, f.compression.states[0]))
    elif accepted.any():
      delta = _round_delta(run, run.server.params, states.params, accepted)
    if accepted.any():
      run.server.apply(delta, 0)
      s.version += 1
    run.model_states.round(states, accepted)
    if membership.absences:
      elastic_lib.barrier_rows(run, start, s.sim_time, real_steps, present, lost)
    _count_round(run, 0, inner_lib.train_loss(metrics) if part.any() else None,
                 int(part.sum()))
    yield


def _with_theta(run: Run, states: inner_lib.InnerState, which: np.ndarray
                ) -> inner_lib.InnerState:
  """K stacked states with θ's params where ``which`` (per worker), the rest as they are."""
  theta = run.executor.to_rounds(run.server.params)
  keep = run.executor.to_rounds(~which)
  return states._replace(params=jax.tree.map(
      lambda x, t: jnp.where(keep.reshape((-1,) + (1,) * t.ndim), x, t[None]),
      states.params, theta))


def _where_part(run: Run, part: np.ndarray, new: Any, old: Any) -> Any:
  """Per worker (axis 0): ``new`` for those that took part in the round, ``old`` for the
  others."""
  keep = run.executor.to_rounds(part)
  return jax.tree.map(lambda x, y: jnp.where(keep.reshape((-1,) + (1,) * (x.ndim - 1)), x, y),
                      new, old)


def _only_part(metrics: inner_lib.InnerMetrics, part: np.ndarray) -> inner_lib.InnerMetrics:
  """``metrics`` with the steps of the workers that took no part marked as reading no batch
  (``inner.train_loss`` leaves them out)."""
  return metrics._replace(pseudo_sync=metrics.pseudo_sync | ~jnp.asarray(part)[:, None])


def _round_delta(run: Run, params: Any, ends: Any, accepted: np.ndarray) -> Any:
  """A round's Δ: the executor's θ − mean of the accepted ends (today's bits), or the run's
  aggregation rule over the accepted Δ_i (ALGORITHMS.md, "Aggregation")."""
  rule, executor = run.spec.syncer.aggregate, run.executor
  if isinstance(rule, aggregate_lib.Mean):
    return executor.round_delta(params, ends, accepted)
  return executor.to_server(aggregate_lib.round_delta(
      rule, executor.to_rounds(params), ends, executor.to_rounds(accepted)))


def _screen_round(run: Run, states: inner_lib.InnerState, real_steps: np.ndarray,
                  part: Optional[np.ndarray] = None) -> np.ndarray:
  """Which workers of a round are accepted (finite params, and of ``part``, those that took
  part: default all); a ``rejected`` row for each other that took part (its ``real_steps``
  counted), and the rejection streak updated."""
  reasons = rejection.reasons(*map(run.executor.to_host,
                                   rejection.nonfinite(states.params, per_worker=True)))
  workers = [i for i in range(len(reasons)) if part is None or part[i]]
  for i in workers:
    if reasons[i] is not None:
      run.reject(i, reasons[i], 0, int(real_steps[i]) * run.spec.units_per_step)
  run.features.rejection.update([reasons[i] for i in workers], workers)
  return np.array([reasons[i] is None and i in workers for i in range(len(reasons))])


def _count_round(run: Run, fragment: int, loss: Any, workers: Optional[int] = None) -> None:
  """The bytes and network seconds of a round's all-reduce of ``fragment`` among ``workers``
  (default all), and its row."""
  up = run.uplink.bytes_up[fragment]
  k = run.spec.num_workers if workers is None else workers
  network = k * run.clock.exposed_allreduce(fragment)
  run.features.traffic.sync(2 * k * up, network)  # all-reduce: each worker's Δ out, the mean back
  _emit_train(run, loss, fragment=fragment, bytes_up=k * up, bytes_down=k * up)


async def _streaming_rounds(run: Run) -> AsyncIterator[None]:
  """Streaming DiLoCo (ALGORITHMS.md, "Fragments"): every H/P steps the workers all-reduce
  fragment j mod P's Δ_p = θ_p − mean_i θ_{i,p} and the outer rule of fragment p applies
  it; the new θ_p replaces (α = 1) or blends into each worker's fragment, τ steps later.
  Workers never restart as a whole (their steps and optimizer states carry on), except one
  that missed a round (FAILURES.md, "Synchronous methods: elastic rounds and steps"): it takes
  θ whole at its next one."""
  s, spec, k = run.state, run.spec, run.spec.num_workers
  f = run.features
  executor, inner, fragments = run.executor, run.executor.inner, run.fragments
  steps, tau, alpha = spec.inner_steps // spec.fragments, spec.overlap_steps, spec.fragment_alpha
  membership = spec.membership
  if s.phase != "rounds":
    s.phase = "rounds"
    s.workers = inner.start_many(executor.to_rounds(run.server.params),
                                 run.model_states.for_round(None), k)
    f.streaming.fragment_versions, f.streaming.syncs = [0] * spec.fragments, [0]
    f.streaming.missed = [False] * k

  def merged(states, p):  # fragment p's new θ_p (and the merged model state) in every worker's
    local = fragments.take(states.params, p)
    arrived = jax.tree.map(lambda x, y: jnp.broadcast_to(x, y.shape),
                           executor.to_rounds(run.server.fragment(p).params), local)
    states = run.model_states.for_round(states)
    return states._replace(params=fragments.put(
        states.params, fragments_lib.merge_arrived(alpha, arrived, local), p))

  while True:
    # Everyone away: the next round starts when one comes back.
    present = await elastic_lib.present(run)
    if present is None:
      return
    j = f.streaming.syncs[0] + 1
    p = j % spec.fragments
    start, planned = s.sim_time, np.where(present, steps, 0)
    units = s.units + int(planned.sum()) * spec.units_per_step
    # Checked before the round, which donates the workers' states (the real clock's seconds
    # are known after it only).
    ahead = (run.clock.fragment_round_seconds(steps, p, start, present)
             if run.clock.simulated else 0)
    if spec.budget.over(units, start + ahead):
      return
    returning = present & np.asarray(f.streaming.missed or [False] * k)
    if returning.any():  # θ as a whole, their step counts and optimizer states kept
      s.workers = _with_theta(run, s.workers, returning)
    # Kept for those who take no part (the round donates the states): known ahead on the
    # simulated clock; on a real clock only after the round.
    before = None
    if membership.absences and not (
        run.clock.simulated and (present & ~membership.lost(present, start, start + ahead)).all()):
      before = jax.tree.map(jnp.copy, s.workers)
    batches = jax.tree.map(lambda *xs: np.stack(xs), *[run.batches(i, steps) for i in range(k)])
    keys = jnp.stack([run.next_key()] * k)
    if tau == 0 or j == 1:
      states, metrics = executor.run_round(s.workers, batches, keys, None)
      metrics = [metrics]
    else:  # τ steps while fragment j − 1's sync is in flight, then it lands
      head, tail = streaming.split_steps(batches, tau, axis=1)
      states, first = executor.run_round(s.workers, head, keys, None)
      states, second = executor.run_round(merged(states, (j - 1) % spec.fragments), tail,
                                          keys, None)
      metrics = [first, second]
    duration = ahead if run.clock.simulated else run.clock.fragment_round_seconds(steps, p,
                                                                                 start)
    # ALGORITHMS.md, "Elastic membership": a worker that leaves before the barrier loses its
    # part of the round; the others' parts are averaged.
    lost = membership.lost(present, start, start + duration)
    part = present & ~lost
    units = s.units + int(planned[part].sum()) * spec.units_per_step
    if spec.budget.over(units, start + duration):  # the real clock ran out during it
      s.workers = states  # the steps were taken; the fragment's sync was not
      return
    s.units, s.sim_time = units, start + duration
    losses = [inner_lib.train_loss(m if part.all() else _only_part(m, part)) for m in metrics]
    loss = (None if not part.any() else losses[0] if len(losses) == 1 else jax.tree.map(
        lambda a, b: (tau * a + (steps - tau) * b) / steps, *losses))
    accepted = _screen_round(run, states, planned, part)
    rejected = part & ~accepted
    if rejected.any():  # a rejected worker starts again from θ, with fresh moments
      states = _with_theta(run, inner.reset_moments(states, executor.to_rounds(rejected)),
                           rejected)
    if not part.all():  # the absent and the lost keep their state from before the round
      states = _where_part(run, part, states, before)
    server = run.server.fragment(p)
    ends = fragments.take(states.params, p)
    if f.compression.states is not None:
      delta, residuals = executor.compressed_round_delta(
          run.uplink, server.params, ends, accepted, f.compression.states[p])
      f.compression.states[p] = (residuals if part.all() else
                                 _where_part(run, part, residuals, f.compression.states[p]))
    elif accepted.any():
      delta = _round_delta(run, server.params, ends, accepted)
    if accepted.any():
      server.apply(delta, 0)
      s.version += 1
      f.streaming.fragment_versions[p] += 1
    run.model_states.round(states, accepted)
    s.workers = merged(states, p) if tau == 0 else states
    f.streaming.syncs[0] = j
    f.streaming.missed = [bool(m) for m in ~part]
    if membership.absences:
      elastic_lib.barrier_rows(run, start, s.sim_time, planned, present, lost)
    _count_round(run, p, loss, int(part.sum()))
    yield


async def run_ddp(run: Run, steps: Optional[int] = None) -> AsyncIterator[None]:
  """DDP steps in chunks of H (all of the budget when ``steps`` is None); the final
  state is ``run.state.workers``."""
  s, spec, k = run.state, run.spec, run.spec.num_workers
  f = run.features
  membership = spec.membership
  if s.phase != "ddp":
    s.phase, s.workers = "ddp", run.executor.inner.start_jit(
        run.executor.to_rounds(run.server.params),  # where DDP steps run
        run.model_states.for_ddp())
    s.ddp_remaining = steps
  while s.ddp_remaining is None or s.ddp_remaining > 0:
    # Everyone away: the next step starts when one comes back.
    present = await elastic_lib.present(run)
    if present is None:
      break
    chunk = spec.inner_steps if s.ddp_remaining is None else min(spec.inner_steps,
                                                                  s.ddp_remaining)
    chunk = spec.budget.units_left(s.units, int(present.sum()) * spec.units_per_step, chunk)
    if chunk <= 0:
      break
    chunk, planned = run.clock.plan_ddp(chunk, s.sim_time, spec.budget.sim_seconds,
                                        present if membership.absences else None)
    if chunk == 0:
      break
    lost = np.zeros(k, bool)
    if membership.absences and planned is not None:  # a real clock's first chunk: no plan
      chunk, planned, lost = elastic_lib.ddp_until_an_event(run, present, planned)
    part = present & ~lost
    workers = int(part.sum())
    start = s.sim_time
    loss = None
    if workers:
      # Averaging the workers' gradients = one step on their batches together.
      batches = jax.tree.map(lambda *xs: np.concatenate(xs, axis=1),
                             *[run.batches(i, chunk) for i in range(k) if part[i]])
      s.workers, loss = run.executor.run_ddp(s.workers, batches, run.next_key())
      run.server.params = run.executor.to_server(jax.tree.map(jnp.array, s.workers.params))
      run.model_states.ddp(s.workers)
    elif planned is not None:  # a step nobody computes still takes its seconds
      await run.clock.wait_until(start + sum(t for t, _ in planned))
    seconds = run.clock.ddp_seconds(planned, s.sim_time, run.server.params if workers else None)
    # Every step all-reduces the gradient: each worker's out, the mean back.
    gradient = run.uplink.model_bytes
    for step in range(chunk):
      exposed = run.clock.ddp_exposed(planned, step)
      f.traffic.sync(2 * workers * gradient, None if exposed is None else workers * exposed)
    s.version += chunk if workers else 0
    s.units += chunk * workers * spec.units_per_step
    s.sim_time += seconds
    if s.ddp_remaining is not None:
      s.ddp_remaining -= chunk
    if membership.absences:
      elastic_lib.barrier_rows(run, start, s.sim_time, np.where(present, chunk, 0), present, lost)
    _emit_train(run, loss, bytes_up=chunk * workers * gradient,
                bytes_down=chunk * workers * gradient)
    yield


LOOPS: dict[str, Callable[[Run], AsyncIterator[None]]] = {
    "async": run_async, "round": run_rounds, "step": run_ddp}
