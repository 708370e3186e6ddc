"""The engine's three loops, one per synchrony of the registry (``Method.synchrony``).

Each loop is an asynchronous generator over a ``state.Run`` that yields after
every outer update (an arrival group, a round, a chunk of DDP steps); the
engine (``runtime.engine``) evaluates, checkpoints and hands the event loop
on at each yield, in one place.

  * ``run_async``: one outer update per arrival with staleness τ = v − s; the
    worker is re-dispatched at once from the server's dispatch point.
    Arrivals within ``grace_window`` seconds of the first are combined into
    one update (``OuterServer.update``). On the simulated clock a dispatch
    fixes its inputs (start point, batches, PRNG key) and its steps are
    computed lazily: when its job reaches the head of the arrival queue (so
    the device works on the next arrival while the host handles this one) or
    when a checkpoint needs it; work a budget discards is never computed. The
    results are those of computing at dispatch, bit for bit.
  * ``run_rounds``: all workers start from θ, run H steps (``vmap``),
    Δ = mean Δ_i, one outer update. PALSGD's rounds pull toward θ̃ = θ and
    keep the inner optimizer states; its DDP warm-up comes first.
  * ``run_ddp``: every step averages the K workers' gradients, which is one
    inner step on their K batches together.
"""

from __future__ import annotations

import functools
from typing import AsyncIterator, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from heloco_jax import clock as clock_lib, inner as inner_lib, rejection
from heloco_jax.runtime import base
from heloco_jax.runtime.state import Job, Run


@functools.partial(jax.jit, static_argnums=1)
def _stack_copies(tree, k: int):
  """``k`` copies of ``tree`` stacked on a new leading axis (one compiled program)."""
  return jax.tree.map(lambda x: jnp.stack([x] * k), tree)


def _emit_train(run: Run, loss, **transfers: int) -> None:
  """The ``train`` row of a round or a DDP chunk: its steps' mean training loss and the
  bytes its workers sent and received."""
  s = run.state
  run.emit({"event": "train", run.spec.unit: s.units, "sim_time": s.sim_time,
            "outer_updates": s.version, **transfers, **run.train_loss(loss)})


def steps_per_dispatch(spec) -> np.ndarray:
  """H for every worker, or DyLU's H_i = max(1, ⌊v_i/v_ref·H⌋) (ALGORITHMS.md, "DyLU")."""
  if spec.dylu:
    return clock_lib.dylu_steps(np.asarray(spec.seconds_per_step, float), spec.inner_steps)
  return np.full(spec.num_workers, spec.inner_steps)


async def run_async(run: Run) -> AsyncIterator[None]:
  """Asynchronous arrivals until the queue is empty or a budget ends."""
  s, spec, clock = run.state, run.spec, run.clock
  steps = steps_per_dispatch(spec)
  queue = run.arrivals()

  def dispatch(worker: int, now: float) -> None:
    work = functools.partial(
        run.executor.run_worker, worker, s.workers[worker], run.server.dispatch_point(),
        run.batches(worker, int(steps[worker])), run.next_key())
    finish = clock.finish(worker, int(steps[worker]), now)
    s.jobs[worker] = Job(None, s.version, int(steps[worker]) * spec.units_per_step,
                         finish, work)
    if clock.eager:
      run.compute(worker)
    queue.push(worker, s.jobs[worker])

  for worker in sorted(s.jobs, key=lambda w: (s.jobs[w].finish, w)):  # restored jobs
    queue.push(worker, s.jobs[worker])
  if s.phase is None:
    s.phase, s.workers = "async", [None] * spec.num_workers
    s.compression = run.uplink.init(run.server.params, spec.num_workers, stacked=False)
    for worker in range(spec.num_workers):
      dispatch(worker, 0.0)
  try:
    while len(queue):
      now, group = await queue.pop(spec.grace_window)
      units = s.units + sum(s.jobs[w].units for w in group)
      if spec.budget.over(units, now):
        break  # this group and everything still in flight are discarded, never computed
      _apply_arrivals(run, group, units, now)
      for w in group:
        dispatch(w, now)
      if not clock.eager:  # the next arrivals compute (on D devices, concurrently)
        _launch_ahead(run, queue)  # while the host goes on
      yield
  finally:
    queue.close()


def _apply_arrivals(run: Run, group: list[int], units: int, now: float) -> None:
  """One arrival group: at most one outer update, its rows, rejected workers reset."""
  s, spec = run.state, run.spec
  for w in group:
    run.compute(w)
  arrived = [s.jobs.pop(w) for w in group]
  s.units, s.sim_time = units, now
  taus = [s.version - job.version for job in arrived]
  results = run.server.update(taus, *(job.delta for job in arrived), fetch=False)
  reasons = [result.pop("reason") for result in results]
  for w, tau, reason, job in zip(group, taus, reasons, arrived):
    if reason is not None:
      run.reject(w, reason, tau, job.units)
      s.workers[w] = run.executor.fresh_moments(s.workers[w])
  if any(reason is None for reason in reasons):
    s.version += 1
  up, down = run.uplink.bytes_up, run.uplink.bytes_down
  s.sync(len(group) * (up + down), _transfer_seconds(run.clock, "dispatch", len(group)))
  for w, tau, reason, result, job in zip(group, taus, reasons, results, arrived):
    if reason is None:
      s.staleness.append(tau)
      run.emit({"event": "arrival", "worker": w, "staleness": tau, spec.unit: s.units,
                "sim_time": now, "outer_updates": s.version, "bytes_up": up,
                "bytes_down": down, **run.train_loss(job.train_loss), **result})
  run.streak.update(reasons, group)


def _transfer_seconds(clock: base.Clock, what: str, count: int) -> Optional[float]:
  """``count`` workers' seconds on the network for a dispatch each (θ down, Δ up) or a
  round (its all-reduce), on a simulated clock; None on real time (not known)."""
  if not clock.simulated:
    return None
  return count * (clock.download + clock.upload if what == "dispatch" else clock.allreduce)


def _launch_ahead(run: Run, queue: base.Arrivals) -> None:
  """Starts the work of the next D arrivals (D = the executor's concurrency), in arrival
  order, unless the budget will discard it as things stand; JAX runs it asynchronously."""
  s, budget = run.state, run.spec.budget
  units = s.units
  for worker in queue.heads(run.executor.concurrency):
    job = s.jobs[worker]
    units += job.units
    if budget.over(units, job.finish):
      return
    run.compute(worker)


async def run_rounds(run: Run) -> AsyncIterator[None]:
  """Synchronous rounds until a budget ends (PALSGD: after its DDP warm-up)."""
  s, spec, k, h = run.state, run.spec, run.spec.num_workers, run.spec.inner_steps
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
      s.workers = _stack_copies(s.workers, k)
  if s.phase != "rounds":
    s.compression = run.uplink.init(executor.to_rounds(run.server.params), k, stacked=True)
  s.phase = "rounds"
  while True:
    # Every worker restarts from θ, keeping its own step count (and its optimizer
    # state unless reset_optimizer).
    theta = executor.to_rounds(run.server.params)
    starts = inner.start_many(theta, s.workers, k)
    batches = jax.tree.map(lambda *xs: np.stack(xs), *[run.batches(i, h) for i in range(k)])
    # The keys draw PALSGD's coins: one per round for all (shared) or one per worker.
    keys = jnp.stack([run.next_key()] * k if spec.palsgd_coins == "shared"
                     else [run.next_key() for _ in range(k)])
    states, metrics = executor.run_round(starts, batches, keys, theta if palsgd else None)
    # PALSGD: pseudo-sync steps read no data and cost no compute time.
    real_steps = h - executor.to_host(metrics.pseudo_sync).sum(axis=1)
    units = s.units + int(real_steps.sum()) * spec.units_per_step
    duration = run.clock.round_seconds(real_steps, s.sim_time)
    if spec.budget.over(units, s.sim_time + duration):
      return
    s.units, s.sim_time = units, s.sim_time + duration
    reasons = rejection.reasons(*map(executor.to_host,
                                     rejection.nonfinite(states.params, per_worker=True)))
    accepted = np.array([reason is None for reason in reasons])
    for i, reason in enumerate(reasons):
      if reason is not None:
        run.reject(i, reason, 0, int(real_steps[i]) * spec.units_per_step)
    run.streak.update(reasons)
    if not accepted.all():
      states = inner.reset_moments(states, executor.to_rounds(~accepted))
    s.workers = states
    if s.compression is not None:  # every worker sends, and keeps its residual
      delta, s.compression = run.uplink.round_delta(run.server.params, states.params, accepted,
                                                    s.compression)
    elif accepted.any():
      delta = executor.round_delta(run.server.params, states.params, accepted)
    if accepted.any():
      run.server.apply(delta, 0)
      s.version += 1
    moved = 2 * k * run.uplink.bytes_up  # all-reduce: each worker's Δ out, the mean back
    s.sync(moved, _transfer_seconds(run.clock, "round", k))
    _emit_train(run, inner_lib.train_loss(metrics), bytes_up=k * run.uplink.bytes_up,
                bytes_down=k * run.uplink.bytes_up)
    yield


async def run_ddp(run: Run, steps: Optional[int] = None) -> AsyncIterator[None]:
  """DDP steps in chunks of H (all of the budget when ``steps`` is None); the final
  state is ``run.state.workers``."""
  s, spec, k = run.state, run.spec, run.spec.num_workers
  step_units = k * spec.units_per_step
  if s.phase != "ddp":
    s.phase, s.workers = "ddp", run.executor.inner.start_jit(
        run.executor.to_rounds(run.server.params))  # where DDP steps run
    s.ddp_remaining = steps
  while s.ddp_remaining is None or s.ddp_remaining > 0:
    chunk = spec.inner_steps if s.ddp_remaining is None else min(spec.inner_steps,
                                                                  s.ddp_remaining)
    chunk = spec.budget.units_left(s.units, step_units, chunk)
    if chunk <= 0:
      break
    chunk, planned = run.clock.plan_ddp(chunk, s.sim_time, spec.budget.sim_seconds)
    if chunk == 0:
      break
    # Averaging K workers' gradients = one step on their K batches together.
    batches = jax.tree.map(lambda *xs: np.concatenate(xs, axis=1),
                           *[run.batches(i, chunk) for i in range(k)])
    s.workers, loss = run.executor.run_ddp(s.workers, batches, run.next_key())
    run.server.params = run.executor.to_server(jax.tree.map(jnp.array, s.workers.params))
    seconds = run.clock.ddp_seconds(planned, s.sim_time, run.server.params)
    # Every step all-reduces the gradient: each worker's out, the mean back.
    gradient = run.uplink.bytes_down
    for step in range(chunk):
      s.sync(2 * k * gradient, None if planned is None else k * planned[step][1])
    s.version += chunk
    s.units += chunk * step_units
    s.sim_time += seconds
    if s.ddp_remaining is not None:
      s.ddp_remaining -= chunk
    _emit_train(run, loss, bytes_up=chunk * k * gradient, bytes_down=chunk * k * gradient)
    yield


LOOPS: dict[str, Callable[[Run], AsyncIterator[None]]] = {
    "async": run_async, "round": run_rounds, "step": run_ddp}
