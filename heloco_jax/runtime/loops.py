"""The engine's three loops, one per synchrony of the registry (``Method.synchrony``).

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

Each yields to the asyncio event loop after every event.
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from heloco_jax import clock as clock_lib, inner as inner_lib, rejection
from heloco_jax.runtime import base
from heloco_jax.runtime.state import Job

if TYPE_CHECKING:
  from heloco_jax.runtime.engine import Engine


@functools.partial(jax.jit, static_argnums=1)
def _stack_copies(tree, k: int):
  """``k`` copies of ``tree`` stacked on a new leading axis (one compiled program)."""
  return jax.tree.map(lambda x: jnp.stack([x] * k), tree)


def _train_loss(engine: "Engine", loss) -> dict:
  """A row's ``train_loss`` field: the mean loss of the inner steps it reports (none for a job
  restored from a checkpoint written before the loss was kept)."""
  loss = engine.runtime.fetch(loss, "train_loss")
  return {} if loss is None else {"train_loss": loss}


def _emit_train(engine: "Engine", loss) -> None:
  """The ``train`` row of a round or a DDP chunk: its steps' mean training loss."""
  s = engine.state
  engine.recorder.emit({"event": "train", engine.spec.unit: s.units, "sim_time": s.sim_time,
                        "outer_updates": s.version, **_train_loss(engine, loss)})


def _steps_per_dispatch(engine: "Engine") -> np.ndarray:
  """H for every worker, or DyLU's H_i = max(1, ⌊v_i/v_ref·H⌋) (ALGORITHMS.md, "DyLU")."""
  spec = engine.spec
  if spec.dylu:
    return clock_lib.dylu_steps(np.asarray(spec.seconds_per_step, float), spec.inner_steps)
  return np.full(spec.num_workers, spec.inner_steps)


async def run_async(engine: "Engine") -> None:
  """Asynchronous arrivals until the queue is empty or a budget ends."""
  s, k, clock = engine.state, engine.spec.num_workers, engine.clock
  steps = _steps_per_dispatch(engine)
  queue = engine.runtime.arrivals(clock, engine.recorder.emit)

  def dispatch(worker: int, now: float) -> None:
    work = functools.partial(
        engine.runtime.run_worker, worker, s.workers[worker], engine.server.dispatch_point(),
        engine.batches(worker, int(steps[worker])), engine.next_key())
    finish = clock.finish(worker, int(steps[worker]), now)
    s.jobs[worker] = Job(None, s.version, int(steps[worker]) * engine.spec.units_per_step,
                         finish, work)
    if clock.eager:
      engine.compute(worker)
    queue.push(worker, s.jobs[worker])

  for worker in sorted(s.jobs, key=lambda w: (s.jobs[w].finish, w)):  # restored jobs
    queue.push(worker, s.jobs[worker])
  if s.phase is None:
    s.phase, s.workers = "async", [None] * k
    for worker in range(k):
      dispatch(worker, 0.0)
  try:
    await _take_arrivals(engine, queue, dispatch)
  finally:
    queue.close()


async def _take_arrivals(engine: "Engine", queue: base.Arrivals,
                         dispatch: Callable[[int, float], None]) -> None:
  """Takes arrival groups from ``queue``: at most one outer update each."""
  s, spec, budget = engine.state, engine.spec, engine.spec.budget
  while len(queue):
    now, group = await queue.pop(spec.grace_window)
    units = s.units + sum(s.jobs[w].units for w in group)
    if budget.over(units, now):
      break  # this group and everything still in flight are discarded, never computed
    for w in group:
      engine.compute(w)
    arrived = [s.jobs.pop(w) for w in group]
    s.units, s.sim_time = units, now
    taus = [s.version - job.version for job in arrived]
    poisons = [spec.fault.value if engine.faulty(w) else None for w in group]
    results = engine.server.update(taus, poisons, *(job.delta for job in arrived), fetch=False)
    reasons = [result.pop("reason") for result in results]
    for w, tau, reason, job in zip(group, taus, reasons, arrived):
      if reason is not None:
        engine.reject(w, reason, tau, job.units)
        s.workers[w] = engine.runtime.fresh_moments(s.workers[w])
    if any(reason is None for reason in reasons):
      s.version += 1
    for w, tau, reason, result, job in zip(group, taus, reasons, results, arrived):
      if reason is None:
        s.staleness.append(tau)
        engine.recorder.emit({"event": "arrival", "worker": w, "staleness": tau,
                              spec.unit: s.units, "sim_time": now, "outer_updates": s.version,
                              **_train_loss(engine, job.train_loss), **result})
    engine.streak.update(reasons, group)
    engine.evaluate()
    for w in group:
      dispatch(w, now)
    if not engine.clock.eager:  # the next arrivals compute (on D devices, concurrently)
      _launch_ahead(engine, queue)  # while the host goes on
    engine.maybe_checkpoint()
    await asyncio.sleep(0)


def _launch_ahead(engine: "Engine", queue: base.Arrivals) -> None:
  """Starts the work of the next D arrivals (D = the runtime's concurrency), in arrival
  order, unless the budget will discard it as things stand; JAX runs it asynchronously."""
  s, budget = engine.state, engine.spec.budget
  units = s.units
  for worker in queue.heads(getattr(engine.runtime, "concurrency", 1)):
    job = s.jobs[worker]
    units += job.units
    if budget.over(units, job.finish):
      return
    engine.compute(worker)


async def run_rounds(engine: "Engine") -> None:
  """Synchronous rounds until a budget ends (PALSGD: after its DDP warm-up)."""
  s, spec, k, h = engine.state, engine.spec, engine.spec.num_workers, engine.spec.inner_steps
  runtime, inner = engine.runtime, engine.runtime.inner
  palsgd = engine.method.inner == "palsgd"
  if palsgd and s.phase in (None, "ddp"):
    warmup = h if spec.palsgd_warmup_steps < 0 else spec.palsgd_warmup_steps
    if warmup:
      warm = await run_ddp(engine, warmup)
      if spec.budget.over(s.units, s.sim_time):
        return
      # The first round continues the warm-up's step count and optimizer state.
      s.workers = _stack_copies(warm, k)
  s.phase = "rounds"
  while True:
    # Every worker restarts from θ, keeping its own step count (and its optimizer
    # state unless reset_optimizer).
    theta = runtime.to_rounds(engine.params)
    starts = inner.start_many(theta, s.workers, k)
    batches = jax.tree.map(lambda *xs: np.stack(xs), *[engine.batches(i, h) for i in range(k)])
    # The keys draw PALSGD's coins: one per round for all (shared) or one per worker.
    keys = jnp.stack([engine.next_key()] * k if spec.palsgd_coins == "shared"
                     else [engine.next_key() for _ in range(k)])
    states, metrics = runtime.run_round(starts, batches, keys, theta if palsgd else None)
    # PALSGD: pseudo-sync steps read no data and cost no compute time.
    real_steps = h - runtime.to_host(metrics.pseudo_sync).sum(axis=1)
    units = s.units + int(real_steps.sum()) * spec.units_per_step
    duration = engine.clock.round_seconds(real_steps, s.sim_time)
    if spec.budget.over(units, s.sim_time + duration):
      return
    s.units, s.sim_time = units, s.sim_time + duration
    for i in range(k):
      if engine.faulty(i):
        states = states._replace(
            params=rejection.poison(states.params, spec.fault.value, worker=i))
    reasons = rejection.reasons(*map(runtime.to_host,
                                     rejection.nonfinite(states.params, per_worker=True)))
    accepted = np.array([reason is None for reason in reasons])
    for i, reason in enumerate(reasons):
      if reason is not None:
        engine.reject(i, reason, 0, int(real_steps[i]) * spec.units_per_step)
    engine.streak.update(reasons)
    if not accepted.all():
      states = inner.reset_moments(states, runtime.to_rounds(~accepted))
    s.workers = states
    if accepted.any():
      engine.server.apply(runtime.round_delta(engine.params, states.params, accepted), 0)
      s.version += 1
    _emit_train(engine, inner_lib.train_loss(metrics))
    engine.evaluate()
    engine.maybe_checkpoint()
    await asyncio.sleep(0)


async def run_ddp(engine: "Engine", steps: Optional[int] = None) -> inner_lib.InnerState:
  """DDP steps in chunks of H (all of the budget when ``steps`` is None)."""
  s, spec, k = engine.state, engine.spec, engine.spec.num_workers
  step_units = k * spec.units_per_step
  if s.phase != "ddp":
    s.phase, s.workers = "ddp", engine.runtime.inner.start_jit(engine.params)
    s.ddp_remaining = steps
  while s.ddp_remaining is None or s.ddp_remaining > 0:
    chunk = spec.inner_steps if s.ddp_remaining is None else min(spec.inner_steps,
                                                                  s.ddp_remaining)
    chunk = spec.budget.units_left(s.units, step_units, chunk)
    if chunk <= 0:
      break
    chunk, planned = engine.clock.plan_ddp(chunk, s.sim_time, spec.budget.sim_seconds)
    if chunk == 0:
      break
    # Averaging K workers' gradients = one step on their K batches together.
    batches = jax.tree.map(lambda *xs: np.concatenate(xs, axis=1),
                           *[engine.batches(i, chunk) for i in range(k)])
    s.workers, loss = engine.runtime.run_ddp(s.workers, batches, engine.next_key())
    engine.params = engine.runtime.to_server(jax.tree.map(jnp.array, s.workers.params))
    seconds = engine.clock.ddp_seconds(planned, s.sim_time, engine.params)
    s.version += chunk
    s.units += chunk * step_units
    s.sim_time += seconds
    if s.ddp_remaining is not None:
      s.ddp_remaining -= chunk
    _emit_train(engine, loss)
    engine.evaluate()
    engine.maybe_checkpoint()
    await asyncio.sleep(0)
  return s.workers


LOOPS = {"async": run_async, "round": run_rounds, "step": run_ddp}
