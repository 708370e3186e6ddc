"""The engine: any method of the registry, any model, on any runtime.

A run is (docs/DESIGN.md, "The idea in one picture"): a ``Method`` of the
registry (synchrony, outer rule, dispatch rule, inner variant), a user's
problem (an ``InnerLoop`` over ``loss_fn`` and ``inner_tx``, initial params,
K per-worker data streams, an optional ``eval_fn``), a ``RunSpec`` (schedule,
budgets, cadence) and a ``Runtime`` with its clock. ``Engine.run`` is an
asyncio coroutine that yields to the event loop after every event.

Synchrony (``Method.synchrony``):
  * async: one outer update per arrival with staleness τ = v − s; the worker
    is re-dispatched at once from the server's dispatch point. Arrivals
    within ``grace_window`` seconds of the first are combined into one
    update (``OuterServer.update``). On the simulated clock a dispatch fixes
    its inputs (start point, batches, PRNG key) and its steps are computed
    lazily: when its job reaches the head of the arrival queue (so the device
    works on the next arrival while the host handles this one) or when a
    checkpoint needs it; work a budget discards is never computed. The
    results are those of computing at dispatch, bit for bit.
  * round: all workers start from θ, run H steps (``vmap``), Δ = mean Δ_i,
    one outer update. PALSGD's rounds pull toward θ̃ = θ and keep the inner
    optimizer states; its DDP warm-up comes first.
  * step (DDP): every step averages the K workers' gradients, which is one
    inner step on their K batches together.

Budgets count *units*: ``units_per_step`` per inner step whose result
reached the server (1: local steps, the authors' budget; the CLI counts
tokens). PALSGD's pseudo-sync steps read no data and count none. Work whose
arrival would pass a budget is discarded, with everything still in flight.

Faults (``heloco_jax.runtime.rejection``): a non-finite pseudo-gradient is
rejected before the outer rule, with a ``{"event": "rejected"}`` row; the
worker restarts with a fresh optimizer state. When every worker's work is
rejected in a row, or an evaluation is not finite, the run stops with a
``DivergenceError`` naming the cause.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import time
from typing import Any, Callable, Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from heloco_jax import clock as clock_lib, inner as inner_lib, methods as methods_lib
from heloco_jax import server as server_lib
from heloco_jax import rejection
from heloco_jax.runtime import base

Row = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Fault:
  """Fault injection for tests: worker ``worker``'s ``arrival``-th result gets a NaN/Inf.

  ``kill_worker`` (Ray) kills that worker's actor at its ``arrival``-th arrival.
  """
  worker: int = -1
  arrival: int = 1
  value: str = "nan"
  kill_worker: int = -1


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """Everything about a run except the problem and the runtime.

  Attributes:
    method: the registry entry (``heloco_jax.methods.METHODS[name]``).
    num_workers: K.
    inner_steps: H.
    seconds_per_step: per worker, simulated seconds per inner step.
    jitter: relative per-step jitter of the simulated clock, in [0, 1).
    comm: message and all-reduce costs.
    dylu: H_i = max(1, ⌊v_i/v_ref·H⌋) (asynchronous methods).
    grace_window: simulated seconds within which arrivals are combined.
    palsgd_warmup_steps: DDP steps before PALSGD's rounds; -1 = H.
    budget_units: 0 = none; else stop before passing this many units.
    budget_sim_seconds: 0 = none; else stop before passing this time.
    eval_every: units between evaluations (0 = at the start and end only).
    units_per_step: units one inner step of one worker counts.
    unit: the name of the unit in rows and the summary ("steps", "tokens").
    checkpoint_every: outer updates between checkpoint hooks (0 = off).
    metrics_fetch_every: arrival rows whose device scalars are fetched together.
    seed: PRNG seed of dispatch keys and the clock's jitter.
    fault: fault injection (tests).
  """
  method: methods_lib.Method
  num_workers: int
  inner_steps: int
  seconds_per_step: tuple[float, ...]
  jitter: float = 0.0
  comm: clock_lib.CommModel = clock_lib.CommModel()
  dylu: bool = False
  grace_window: float = 0.0
  palsgd_warmup_steps: int = -1
  budget_units: int = 0
  budget_sim_seconds: float = 0.0
  eval_every: int = 0
  units_per_step: int = 1
  unit: str = "steps"
  checkpoint_every: int = 0
  metrics_fetch_every: int = 16
  seed: int = 0
  fault: Fault = Fault()

  def over_budget(self, units: int, sim_time: float) -> bool:
    """Whether work ending at (units, sim_time) passes a budget."""
    return ((self.budget_units > 0 and units > self.budget_units)
            or (self.budget_sim_seconds > 0 and sim_time > self.budget_sim_seconds))


class WorkerStream:
  """One worker's batches, with a position a checkpoint can save and restore.

  Iterators with ``get_state``/``set_state`` (grain's) save their own
  position; for any other iterable the count of batches read is saved, and a
  restore iterates ``source`` anew and skips that many.
  """

  def __init__(self, source: Iterable[Any]):
    self._source = source
    self._iterator = source if hasattr(source, "get_state") else iter(source)
    self._read = 0

  def next(self, steps: int) -> Any:
    """The next ``steps`` batches, stacked on a new leading axis (leaf by leaf)."""
    batches = []
    for _ in range(steps):
      try:
        batches.append(next(self._iterator))
      except StopIteration:
        raise ValueError(f"a worker's data ran out after {self._read} batches; allowed: "
                         "iterables that yield a batch for every inner step of the run "
                         "(e.g. endless iterators, or a budget that fits the data)") from None
      self._read += 1
    return jax.tree.map(lambda *xs: np.stack(xs), *batches)

  def get_state(self) -> Any:
    if hasattr(self._iterator, "get_state"):
      return self._iterator.get_state()
    return {"batches_read": self._read}

  def set_state(self, state: Any) -> None:
    if hasattr(self._iterator, "set_state"):
      self._iterator.set_state(state)
      return
    if self._iterator is self._source:
      raise ValueError("cannot resume a worker's data: it is a one-shot iterator; allowed: "
                       "a re-iterable (e.g. a list or a grain dataset) or an iterator with "
                       "get_state/set_state")
    self._iterator, self._read = iter(self._source), 0
    for _ in range(state["batches_read"]):
      next(self._iterator)
      self._read += 1


class Recorder:
  """The run's metrics rows: arrival rows' device scalars fetched in batches.

  Args:
    fetch_every: arrival rows queued before one device-to-host transfer.
  """

  def __init__(self, fetch_every: int):
    self.fetch_every = fetch_every
    self.rows: list[Row] = []
    self.on_row: Callable[[Row], None] = lambda row: None
    self._unfetched: list[Row] = []

  def emit(self, row: Row) -> None:
    """Queues ``row``; arrival rows are fetched ``fetch_every`` at a time."""
    self._unfetched.append(row)
    if row["event"] != "arrival" or len(self._unfetched) >= self.fetch_every:
      self.flush()

  def flush(self) -> None:
    """Fetches the queued rows' device scalars (one transfer) and hands the rows on."""
    rows, self._unfetched = server_lib.to_host(self._unfetched), []
    for row in rows:
      self.rows.append(row)
      self.on_row(row)


@dataclasses.dataclass
class Job:
  """A dispatched worker's result, waiting for its finish time.

  ``delta`` is None while the work is deferred: ``work`` then computes
  (end state, Δ) from the inputs fixed at dispatch (simulated clock).
  """
  delta: Any
  version: int
  units: int
  finish: float
  work: Optional[Callable[[], tuple[Any, Any]]] = None


@dataclasses.dataclass
class RunState:
  """The host side of a run's state: counters, cadences and the loop's position.

  ``phase`` says which loop runs (None before the first, "ddp", "rounds",
  "async"); ``workers`` holds the workers' inner states and ``jobs`` the
  work in flight.
  """
  units: int = 0
  sim_time: float = 0.0
  version: int = 0
  staleness: list = dataclasses.field(default_factory=list)
  phase: Optional[str] = None
  workers: Any = None
  jobs: dict = dataclasses.field(default_factory=dict)
  ddp_remaining: Optional[int] = None
  arrivals: list = dataclasses.field(default_factory=list)
  rejected_in_a_row: int = 0
  initial_eval: Row = dataclasses.field(default_factory=dict)
  last_eval: Row = dataclasses.field(default_factory=dict)
  next_eval: float = 0
  next_checkpoint: int = 0
  wall_before: float = 0.0

  META = ("units", "sim_time", "version", "staleness", "phase", "ddp_remaining", "arrivals",
          "rejected_in_a_row", "initial_eval", "last_eval", "next_eval", "next_checkpoint",
          "wall_before")

  def meta(self) -> dict[str, Any]:
    """The JSON-serialisable fields (a checkpoint's meta)."""
    meta = {name: getattr(self, name) for name in self.META}
    meta["next_eval"] = None if self.next_eval == math.inf else self.next_eval
    meta["jobs"] = [[w, job.version, job.units, job.finish]
                    for w, job in sorted(self.jobs.items())]
    return meta

  def load(self, meta: dict[str, Any], pending: list[Any], workers: Any) -> None:
    for name in self.META:
      setattr(self, name, meta[name])
    self.staleness, self.arrivals = list(self.staleness), list(self.arrivals)
    self.next_eval = math.inf if meta["next_eval"] is None else meta["next_eval"]
    self.jobs = {w: Job(delta, version, units, finish)
                 for (w, version, units, finish), delta in zip(meta["jobs"], pending)}
    self.workers = workers


@functools.partial(jax.jit, static_argnums=1)
def _stack_copies(tree: Any, k: int) -> Any:
  """``k`` copies of ``tree`` stacked on a new leading axis (one compiled program)."""
  return jax.tree.map(lambda x: jnp.stack([x] * k), tree)


def eval_metrics(value: Any) -> dict[str, float]:
  """An ``eval_fn``'s result as ``{"val_loss": ..., ...}`` of Python floats."""
  value = jax.device_get(value)
  if not isinstance(value, dict):
    return {"val_loss": float(value)}
  return {key: float(v) for key, v in value.items()}


class Engine:
  """One run of ``spec`` on ``runtime``.

  Args:
    spec: the ``RunSpec``.
    runtime: where work runs (``heloco_jax.runtime.make_runtime``).
    params: the initial θ (any pytree).
    data: K per-worker iterables of batches (pytrees of arrays).
    outer_tx: the outer rule (None for DDP).
    eval_fn: ``params -> loss`` or ``-> {"val_loss": ..., ...}``; None: no evaluations.
    lookahead: dispatch from θ − η·μ·m.
    arrival_weight: ρ(τ), for combining a grace window's arrivals.
  """

  def __init__(self, spec: RunSpec, runtime: base.Runtime, params: Any,
               data: Sequence[Iterable[Any]], outer_tx: Any = None,
               eval_fn: Optional[Callable[[Any], Any]] = None, lookahead: bool = False,
               arrival_weight: Optional[Callable[[int], float]] = None):
    if len(data) != spec.num_workers:
      raise ValueError(f"data holds {len(data)} worker streams; allowed: one per worker "
                       f"(num_workers={spec.num_workers})")
    if spec.method.outer is not None and outer_tx is None:
      raise ValueError(f"method={spec.method.name!r} needs an outer rule (outer_tx)")
    self.spec = spec
    self.method = spec.method
    self.runtime = runtime
    self.inner = runtime.inner
    self.num_params = int(sum(np.size(x) for x in jax.tree.leaves(params)))
    self.model_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))
    self.streams = [WorkerStream(source) for source in data]
    self.eval_fn = eval_fn
    self.server = runtime.make_server(outer_tx, params, lookahead=lookahead,
                                      arrival_weight=arrival_weight)
    self.clock = runtime.make_clock(np.asarray(spec.seconds_per_step, float), spec.jitter,
                                    spec.seed, spec.comm, self.model_bytes)
    self.recorder = Recorder(spec.metrics_fetch_every)
    self.key = jax.random.key(spec.seed)
    self.state = RunState(arrivals=[0] * spec.num_workers,
                          next_checkpoint=spec.checkpoint_every)
    self.streak = rejection.RejectionStreak(spec.num_workers)
    self._on_checkpoint: Optional[Callable[[Engine], None]] = None
    self._wall_start = time.perf_counter()

  # θ and the outer state live on the server (``heloco_jax.server``).

  @property
  def params(self) -> Any:
    return self.server.params

  @params.setter
  def params(self, value: Any) -> None:
    self.server.params = value

  @property
  def outer_state(self) -> Any:
    return self.server.outer_state

  @property
  def rows(self) -> list[Row]:
    return self.recorder.rows

  @property
  def units(self) -> int:
    return self.state.units

  @property
  def version(self) -> int:
    return self.state.version

  @property
  def sim_time(self) -> float:
    return self.state.sim_time

  # ------------------------------------------------------------ checkpoints

  def checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole run state at a loop boundary: (arrays, JSON-serialisable meta)."""
    s = self.state
    for worker in s.jobs:
      self._compute(worker)
    params, outer_state = self.server.get()
    fetch = self.runtime.fetch  # Ray: waits for work still in flight
    arrays = {"params": params, "outer_state": outer_state,
              "key": jax.random.key_data(self.key),
              "workers": fetch(s.workers, "state"),
              "pending": [fetch(s.jobs[w].delta, "delta") for w in sorted(s.jobs)]}
    meta = s.meta()
    meta["wall_before"] = s.wall_before + time.perf_counter() - self._wall_start
    meta["clock"] = self.clock.get_state()
    meta["streams"] = [stream.get_state() for stream in self.streams]
    return arrays, meta

  def state_template(self, meta: dict[str, Any]) -> dict[str, Any]:
    """The abstract arrays of a ``checkpoint_state()`` with this ``meta`` (for restoring)."""
    worker = jax.eval_shape(self.inner.start, self.params)
    k = self.spec.num_workers
    stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((k, *x.shape), x.dtype), worker)
    workers = {None: None, "ddp": worker, "rounds": stacked, "async": [worker] * k}[meta["phase"]]
    return {"params": self.params, "outer_state": self.outer_state,
            "key": jax.random.key_data(self.key), "workers": workers,
            "pending": [self.params] * len(meta["jobs"])}

  def load_state(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
    """Continues from a ``checkpoint_state()`` of a run with the same spec."""
    self.server.set(arrays["params"], arrays["outer_state"])
    self.key = jax.random.wrap_key_data(arrays["key"])
    self.state.load(meta, arrays["pending"], arrays["workers"])
    self.streak.count = self.state.rejected_in_a_row
    self.clock.set_state(meta["clock"])
    for stream, position in zip(self.streams, meta["streams"], strict=True):
      stream.set_state(position)

  def _maybe_checkpoint(self) -> None:
    """Calls the checkpoint hook when the update count reaches the next multiple."""
    every, s = self.spec.checkpoint_every, self.state
    if every <= 0 or s.version < s.next_checkpoint:
      return
    s.next_checkpoint = (s.version // every + 1) * every
    self.recorder.flush()  # the checkpoint's rows are all written before it
    if self._on_checkpoint is not None:
      s.rejected_in_a_row = self.streak.count
      self._on_checkpoint(self)

  # ------------------------------------------------------------------ helpers

  def _evaluate(self, force: bool = False) -> None:
    """An eval row when the unit count has passed the next eval point (or forced)."""
    s = self.state
    if self.eval_fn is None or (not force and s.units < s.next_eval):
      return
    every = self.spec.eval_every
    s.next_eval = (s.units // every + 1) * every if every > 0 else math.inf
    metrics = eval_metrics(self.eval_fn(self.params))
    bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
    if bad:
      where = ("before training" if s.version == 0 and s.units == 0
               else f"after {s.version} outer updates")
      raise rejection.DivergenceError(
          f"the evaluation {where} is not finite ({', '.join(f'{k}={v}' for k, v in bad.items())})"
          ": the run diverged" + (", or the model cannot take the data (e.g. a token id outside "
                                  "the vocabulary)" if s.version == 0 else ""))
    row = {"event": "eval", self.spec.unit: s.units, "sim_time": s.sim_time,
           "outer_updates": s.version, **metrics}
    s.last_eval = row
    self.recorder.emit(row)

  def _batches(self, worker: int, steps: int) -> Any:
    return self.streams[worker].next(steps)

  def _compute(self, worker: int) -> Any:
    """``worker``'s pending Δ, running its deferred inner steps first if needed."""
    job = self.state.jobs[worker]
    if job.work is not None:
      self.state.workers[worker], job.delta = job.work()
      job.work = None
    return job.delta

  def _next_key(self) -> jax.Array:
    self.key, key = jax.random.split(self.key)
    return key

  def _faulty(self, worker: int) -> bool:
    """Counts ``worker``'s arrival; True if the fault switch poisons this one."""
    self.state.arrivals[worker] += 1
    fault = self.spec.fault
    if fault.kill_worker == worker and fault.arrival == self.state.arrivals[worker]:
      self.runtime.kill_worker(worker)
    return fault.worker == worker and fault.arrival == self.state.arrivals[worker]

  def _reject(self, worker: int, reason: str, staleness: int) -> None:
    self.recorder.emit({"event": "rejected", "worker": worker, "reason": reason,
                        "staleness": staleness, "sim_time": self.state.sim_time,
                        "outer_updates": self.state.version})

  # ----------------------------------------------------------------- the loops

  async def run(self, on_row: Optional[Callable[[Row], None]] = None,
                on_checkpoint: Optional[Callable[["Engine"], None]] = None) -> dict[str, Any]:
    """Runs (or, after ``load_state``, continues) until a budget ends.

    Args:
      on_row: called with every metrics row as it is emitted.
      on_checkpoint: called with the engine every ``checkpoint_every`` outer
        updates, at a point where ``checkpoint_state()`` is the whole run state.

    Returns:
      The summary (docs/DESIGN.md, summary.json); ``wall_seconds`` adds up
      the wall time of every resumed part.

    Raises:
      DivergenceError: every worker's work was rejected in a row, or an
        evaluation is not finite.
    """
    if on_row is not None:
      self.recorder.on_row = on_row
    self._on_checkpoint = on_checkpoint
    self._wall_start = time.perf_counter()
    s = self.state
    self.clock.start(s.sim_time)
    if s.phase is None:
      self._evaluate(force=True)
      s.initial_eval = s.last_eval
    loop = {"async": self._run_async, "round": self._run_rounds,
            "step": functools.partial(self._run_ddp, None)}[self.method.synchrony]
    try:
      await loop()
    finally:
      self.recorder.flush()  # the rows up to a DivergenceError are kept too
    if self.eval_fn is not None and (s.last_eval[self.spec.unit] != s.units
                                     or s.last_eval["sim_time"] != s.sim_time):
      self._evaluate(force=True)
    wall = s.wall_before + time.perf_counter() - self._wall_start
    unit = self.spec.unit
    summary = {"method": self.method.name, "seed": self.spec.seed, unit: s.units,
               "sim_time": s.sim_time, "outer_updates": s.version}
    if self.eval_fn is not None:
      summary["initial_val_loss"] = s.initial_eval["val_loss"]
      summary["final_val_loss"] = s.last_eval["val_loss"]
    summary.update({
        "mean_staleness": float(np.mean(s.staleness)) if s.staleness else 0.0,
        "wall_seconds": wall, f"{unit}_per_second": s.units / wall,
        "num_params": self.num_params})
    return summary

  def close(self) -> None:
    """Releases the runtime's resources (Ray: its actors); θ is gone after."""
    self.runtime.close()

  def _steps_per_dispatch(self) -> np.ndarray:
    spec = self.spec
    if spec.dylu:
      return clock_lib.dylu_steps(np.asarray(spec.seconds_per_step, float), spec.inner_steps)
    return np.full(spec.num_workers, spec.inner_steps)

  async def _run_async(self) -> None:
    s, k, clock = self.state, self.spec.num_workers, self.clock
    steps = self._steps_per_dispatch()
    queue = self.runtime.arrivals(clock, self.recorder.emit)

    def dispatch(worker: int, now: float) -> None:
      work = functools.partial(
          self.runtime.run_worker, worker, s.workers[worker], self.server.dispatch_point(),
          self._batches(worker, int(steps[worker])), self._next_key())
      finish = clock.finish(worker, int(steps[worker]), now)
      s.jobs[worker] = Job(None, s.version, int(steps[worker]) * self.spec.units_per_step,
                           finish, work)
      if clock.eager:
        self._compute(worker)
      queue.push(worker, s.jobs[worker])

    for worker in sorted(s.jobs, key=lambda w: (s.jobs[w].finish, w)):  # restored jobs
      queue.push(worker, s.jobs[worker])
    if s.phase is None:
      s.phase, s.workers = "async", [None] * k
      for worker in range(k):
        dispatch(worker, 0.0)
    try:
      await self._async_loop(queue, dispatch)
    finally:
      queue.close()

  async def _async_loop(self, queue: base.Arrivals, dispatch: Callable[[int, float], None]):
    """Takes arrivals from ``queue`` until it is empty or a budget ends."""
    s, spec = self.state, self.spec
    while len(queue):
      now, group = await queue.pop(spec.grace_window)
      units = s.units + sum(s.jobs[w].units for w in group)
      if spec.over_budget(units, now):
        break  # this group and everything still in flight are discarded, never computed
      for w in group:
        self._compute(w)
      arrived = [s.jobs.pop(w) for w in group]
      s.units, s.sim_time = units, now
      taus = [s.version - job.version for job in arrived]
      poisons = [spec.fault.value if self._faulty(w) else None for w in group]
      results = self.server.update(taus, poisons, *(job.delta for job in arrived), fetch=False)
      reasons = [result.pop("reason") for result in results]
      for w, tau, reason in zip(group, taus, reasons):
        if reason is not None:
          self._reject(w, reason, tau)
          s.workers[w] = self.runtime.fresh_moments(s.workers[w])
      if any(reason is None for reason in reasons):
        s.version += 1
      for w, tau, reason, result in zip(group, taus, reasons, results):
        if reason is None:
          s.staleness.append(tau)
          self.recorder.emit({"event": "arrival", "worker": w, "staleness": tau,
                              "sim_time": now, "outer_updates": s.version, **result})
      self.streak.update(reasons)
      self._evaluate()
      for w in group:
        dispatch(w, now)
      if not self.clock.eager and len(queue):  # the next arrival computes while the host
        job = s.jobs[queue.head()]  # goes on, unless the budget will discard it
        if not spec.over_budget(s.units + job.units, job.finish):
          self._compute(queue.head())
      self._maybe_checkpoint()
      await asyncio.sleep(0)

  async def _run_rounds(self) -> None:
    s, spec, k, h = self.state, self.spec, self.spec.num_workers, self.spec.inner_steps
    runtime = self.runtime
    palsgd = self.method.inner == "palsgd"
    if palsgd and s.phase in (None, "ddp"):
      warmup = h if spec.palsgd_warmup_steps < 0 else spec.palsgd_warmup_steps
      if warmup:
        warm = await self._run_ddp(warmup)
        if spec.over_budget(s.units, s.sim_time):
          return
        # The first round continues the warm-up's step count and optimizer state.
        s.workers = _stack_copies(warm, k)
    s.phase = "rounds"
    while True:
      # Every worker restarts from θ, keeping its own step count (and its optimizer
      # state unless reset_optimizer).
      theta = runtime.to_rounds(self.params)
      starts = self.inner.start_many(theta, s.workers, k)
      batches = jax.tree.map(lambda *xs: np.stack(xs), *[self._batches(i, h) for i in range(k)])
      keys = jnp.stack([self._next_key() for _ in range(k)])
      states, metrics = runtime.run_round(starts, batches, keys, theta if palsgd else None)
      # PALSGD: pseudo-sync steps read no data and cost no compute time.
      real_steps = h - runtime.to_host(metrics.pseudo_sync).sum(axis=1)
      units = s.units + int(real_steps.sum()) * spec.units_per_step
      duration = self.clock.round_seconds(real_steps, s.sim_time)
      if spec.over_budget(units, s.sim_time + duration):
        return
      s.units, s.sim_time = units, s.sim_time + duration
      for i in range(k):
        if self._faulty(i):
          states = states._replace(
              params=rejection.poison(states.params, spec.fault.value, worker=i))
      reasons = rejection.reasons(*map(runtime.to_host,
                                       rejection.nonfinite(states.params, per_worker=True)))
      accepted = np.array([reason is None for reason in reasons])
      for i, reason in enumerate(reasons):
        if reason is not None:
          self._reject(i, reason, 0)
      self.streak.update(reasons)
      if not accepted.all():
        states = self.inner.reset_moments(states, runtime.to_rounds(~accepted))
      s.workers = states
      if accepted.any():
        self.server.apply(runtime.round_delta(self.params, states.params, accepted), 0)
        s.version += 1
      self._evaluate()
      self._maybe_checkpoint()
      await asyncio.sleep(0)

  async def _run_ddp(self, steps: Optional[int]) -> inner_lib.InnerState:
    """DDP steps in chunks of H (all of the budget when ``steps`` is None)."""
    s, spec, k = self.state, self.spec, self.spec.num_workers
    step_units = k * spec.units_per_step
    if s.phase != "ddp":
      s.phase, s.workers = "ddp", self.inner.start(self.params)
      s.ddp_remaining = steps
    while s.ddp_remaining is None or s.ddp_remaining > 0:
      chunk = (spec.inner_steps if s.ddp_remaining is None
               else min(spec.inner_steps, s.ddp_remaining))
      if spec.budget_units > 0:
        chunk = min(chunk, (spec.budget_units - s.units) // step_units)
      if chunk <= 0:
        break
      chunk, planned = self.clock.plan_ddp(chunk, s.sim_time, spec.budget_sim_seconds)
      if chunk == 0:
        break
      # Averaging K workers' gradients = one step on their K batches together.
      batches = jax.tree.map(lambda *xs: np.concatenate(xs, axis=1),
                             *[self._batches(i, chunk) for i in range(k)])
      s.workers = self.runtime.run_ddp(s.workers, batches, self._next_key())
      self.params = self.runtime.to_server(jax.tree.map(jnp.array, s.workers.params))
      seconds = self.clock.ddp_seconds(planned, s.sim_time, self.params)
      s.version += chunk
      s.units += chunk * step_units
      s.sim_time += seconds
      if s.ddp_remaining is not None:
        s.ddp_remaining -= chunk
      self._evaluate()
      self._maybe_checkpoint()
      await asyncio.sleep(0)
    return s.workers


def run(engine: Engine, on_row: Optional[Callable[[Row], None]] = None,
        on_checkpoint: Optional[Callable[[Engine], None]] = None) -> dict[str, Any]:
  """``asyncio.run(engine.run(...))``, with a clear error inside a running event loop."""
  try:
    asyncio.get_running_loop()
  except RuntimeError:
    return asyncio.run(engine.run(on_row, on_checkpoint))
  raise RuntimeError("this call cannot run inside a running event loop (e.g. a Jupyter "
                     "kernel); there, `await engine.run()` does the same (build the engine "
                     "with hj.make_engine / heloco_jax.harness.Simulation).")
