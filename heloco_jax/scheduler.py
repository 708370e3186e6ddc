"""The scheduler: any method of the registry on heterogeneous workers.

Simulated runtime (DESIGN.md, "Runtimes"): one process; a worker's inputs
(dispatch point, batches, PRNG key) are fixed when it is dispatched and its
result is delivered at its simulated finish time. Its inner steps are
computed lazily: when the job reaches the head of the arrival heap (so the
device works on the next arrival while the host handles this one), or when a
checkpoint needs it. Work still in flight when a budget ends is never
computed, so K workers cost no more compute than the arrivals they deliver;
the results are those of computing at dispatch, bit for bit. Arrivals are
taken from a heap ordered by (finish time, worker), so ties break
deterministically and a run reproduces bit for bit. The arrival rows'
diagnostics stay on the device until ``metrics_fetch_every`` rows are
queued, then come over in one transfer; the one host read per arrival is
its pseudo-gradient's finiteness, which decides whether θ changes. ``Simulation.run`` is an asyncio coroutine that yields to the event loop
after every event, so progress displays interleave with it.

Devices runtime (``runtime=devices``, ``heloco_jax.devices``): the same loop,
with each worker's steps on its own device group and the server on one
device; arrivals come in the order the devices finish them, on the real clock.
With ``distributed.*`` set, synchronous methods run SPMD across processes.
Ray runtime (``runtime=ray``, ``heloco_jax.ray_runtime``): the same loop, with
the server and the workers as Ray actors. Everything that touches θ goes
through ``self.server`` (``heloco_jax.server.OuterServer`` or its actor).

Synchrony (``heloco_jax.methods``):
  * async: one outer update per arrival with staleness τ = v − s; the worker
    is re-dispatched at once from θ (or the look-ahead point θ − η·μ·m).
    Its arrival row carries ``cosine_mean``, the mean over leaves of
    cos(Δ, m) with the momentum m it meets (HeLoCo: over its blocks).
    Arrivals within ``grace_window`` seconds of the first are combined into
    one update: the mean of their g = ρ(τ_j)·Δ_j, passed to the rule as
    Δ = mean_j g_j / ρ(τ_max) with staleness τ_max, so the rule's ρ(τ_max)·Δ
    is that mean. Times: message + compute + message.
  * round: all workers start from θ, run H steps (``vmap``), Δ = mean Δ_i,
    one outer update; a round lasts as long as its slowest worker plus one
    ring all-reduce. PALSGD's rounds pull toward θ̃ = θ and keep the inner
    optimizer states; its DDP warm-up comes first.
  * step (DDP): every step averages the K workers' gradients, which is one
    AdamW step on their K batches together; a step lasts as long as the
    slowest worker's step plus one all-reduce.

Budgets: ``budget.tokens`` counts the tokens of the inner steps whose results
reached the server, applied or rejected (PALSGD's pseudo-sync steps read
none); ``budget.sim_seconds`` the simulated clock. Work whose arrival would
pass either budget is discarded, with everything still in flight.

Faults: a pseudo-gradient with a NaN or Inf is rejected before it reaches the
outer rule: a ``{"event": "rejected"}`` row names the worker and the reason,
θ and the outer state stay as they were, and the worker is re-dispatched with
fresh AdamW moments (its step count kept). In a round the other workers'
mean is applied. ``fault.worker`` / ``fault.arrival`` / ``fault.value``
inject such a pseudo-gradient (one element of the first leaf) for tests.

Checkpoints (``heloco_jax.checkpoint``): every ``checkpoint_every`` outer
updates the ``on_checkpoint`` hook of ``run`` receives the simulation, whose
``state()`` is the whole run state: θ, the outer state, every worker's inner
state and pending pseudo-gradient with its version, tokens and finish time,
the clock's RNG, the data iterators' positions, the PRNG key and the
counters. ``load_state`` continues a fresh ``Simulation`` of the same config
from it, bit for bit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import heapq
import math
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from heloco_jax import clock, data as data_lib, devices as devices_lib, evaluate
from heloco_jax import inner as inner_lib, model as model_lib
from heloco_jax import server as server_lib
from heloco_jax.methods import METHODS

Row = dict[str, Any]


@dataclasses.dataclass
class _Job:
  """A dispatched worker's result, waiting for its simulated finish time.

  ``delta`` is None while the work is deferred: ``work`` then computes
  (end state, Δ) from the inputs fixed at dispatch (simulated runtime).
  """
  delta: Any
  version: int
  tokens: int
  finish: float
  work: Optional[Callable[[], tuple[Any, Any]]] = None


class _SimulatedArrivals:
  """Jobs in flight on the simulated clock, popped by (finish time, worker).

  (finish, worker) pairs are unique, so a heap rebuilt from restored jobs pops
  in the same order as the one it replaces.
  """

  def __init__(self):
    self._heap: list[tuple[float, int]] = []

  def __len__(self) -> int:
    return len(self._heap)

  def push(self, worker: int, job: _Job) -> None:
    heapq.heappush(self._heap, (job.finish, worker))

  def head(self) -> Optional[int]:
    """The worker whose job arrives next, or None when none is in flight."""
    return self._heap[0][1] if self._heap else None

  async def pop(self, grace_window: float) -> tuple[float, list[int]]:
    """(finish time of the group's last arrival, its workers in arrival order)."""
    first, worker = heapq.heappop(self._heap)
    group, now = [worker], first
    # A grace window of 0 (default) is off: simultaneous arrivals stay separate updates.
    while grace_window > 0 and self._heap and self._heap[0][0] <= first + grace_window:
      now, other = heapq.heappop(self._heap)
      group.append(other)
    return now, group

  def close(self) -> None:
    self._heap.clear()


@functools.partial(jax.jit, static_argnums=1)
def _stack_copies(tree: Any, k: int) -> Any:
  """``k`` copies of ``tree`` stacked on a new leading axis (one compiled program)."""
  return jax.tree.map(lambda x: jnp.stack([x] * k), tree)


def _languages(value: Any) -> Optional[list[str]]:
  if not value:
    return None
  return [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value)


def make_dataset(config: ml_collections.ConfigDict) -> data_lib.Data:
  """The run's data (languages, per-worker iterators, validation set) from ``config.data``."""
  return data_lib.make_data(
      source=config.data.source, path=config.data.path or None,
      languages=_languages(config.data.languages), partition=config.data.partition,
      dirichlet_alpha=config.data.dirichlet_alpha, num_workers=config.num_workers,
      context=config.model.context, batch_size=config.batch_size,
      val_sequences_per_language=config.data.val_sequences_per_language, seed=config.seed,
      max_bytes_per_language=config.data.max_bytes_per_language or None)


def make_inner_loop(config: ml_collections.ConfigDict, graphdef: Any) -> inner_lib.InnerLoop:
  """The workers' compiled inner loop; AdamW moments reset per the method unless set."""
  reset = (METHODS[config.method].reset_optimizer if config.inner.reset_optimizer < 0
           else bool(config.inner.reset_optimizer))
  return inner_lib.InnerLoop(graphdef, inner_lib.config_from(config.inner, reset))


class Simulation:
  """One run of ``config`` (see ``heloco_jax/configs/default.py``) on the simulated clock.

  Args:
    config: the run's ``ml_collections.ConfigDict``.
    dataset: a ``heloco_jax.data.Data`` to use instead of building one from
      ``config.data`` (tests share one across runs).
  """

  def __init__(self, config: ml_collections.ConfigDict,
               dataset: Optional[data_lib.Data] = None):
    self.config = config
    self.method = METHODS[config.method]
    k = config.num_workers
    self.graphdef, params = model_lib.init(model_lib.config_from(config.model), config.seed)
    self.num_params = model_lib.num_params(params)
    self.model_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    self.data = dataset or make_dataset(config)
    self.evaluator = evaluate.Evaluator(self.graphdef, self.data.validation_tokens,
                                        self.data.validation_language_ids, self.data.languages)
    self.inner = make_inner_loop(config, self.graphdef)
    if config.runtime == "devices":
      groups = devices_lib.group_devices(
          k, config.batch_size, config.devices.group_sizes, config.devices.server,
          config.devices.slowdown, synchronous=self.method.synchrony == "round")
      self.placement = devices_lib.DevicePlacement(self.inner, groups)
    elif config.runtime == "ray":
      from heloco_jax import ray_runtime  # pylint: disable=g-import-not-at-top
      self.placement = ray_runtime.RayPlacement(config, self.inner)
    else:
      self.placement = devices_lib.HostPlacement(self.inner)
    # θ, the outer state and the outer rule (a Ray actor for runtime=ray).
    self.server = self.placement.make_server(config, params)
    self.seconds = clock.seconds_per_step(config.speeds, k)
    self.step_clock = clock.StepClock(self.seconds, config.jitter, config.seed)
    self.comm = clock.CommModel(config.comm.latency, config.comm.bandwidth or math.inf)
    self.iterators = [self.data.worker_iterator(i) for i in range(k)]
    self.tokens_per_step = config.batch_size * config.model.context
    self.key = jax.random.key(config.seed)
    self.tokens = 0
    self.sim_time = 0.0
    self.version = 0
    self.staleness: list[int] = []
    self.rows: list[Row] = []
    # The runtime loop's own state (see ``state``): which loop runs, the workers'
    # inner states, the jobs in flight, DDP steps left, arrivals per worker.
    self.phase: Optional[str] = None
    self.workers: Any = None
    self.jobs: dict[int, _Job] = {}
    self.ddp_remaining: Optional[int] = None
    self.arrivals = [0] * k
    self.initial_val_loss = math.nan
    self._last_eval: Row = {}
    self._next_eval = 0
    self._next_checkpoint = config.checkpoint_every
    self._wall_before = 0.0
    self._on_row: Callable[[Row], None] = lambda row: None
    self._unfetched: list[Row] = []  # rows whose diagnostics are still on the device
    self._on_checkpoint: Optional[Callable[[Simulation], None]] = None

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

  @outer_state.setter
  def outer_state(self, value: Any) -> None:
    self.server.outer_state = value

  # ------------------------------------------------------------ checkpoints

  def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole run state at a loop boundary: (arrays, JSON-serialisable meta)."""
    for worker in self.jobs:
      self._compute(worker)
    params, outer_state = self.server.get()
    fetch = self.placement.fetch  # runtime=ray: waits for work still in flight
    arrays = {"params": params, "outer_state": outer_state,
              "key": jax.random.key_data(self.key),
              "workers": fetch(self.workers, "state"),
              "pending": [fetch(self.jobs[w].delta, "delta") for w in sorted(self.jobs)]}
    meta = {
        "phase": self.phase,
        "jobs": [[w, job.version, job.tokens, job.finish] for w, job in sorted(self.jobs.items())],
        "ddp_remaining": self.ddp_remaining, "arrivals": self.arrivals,
        "tokens": self.tokens, "sim_time": self.sim_time, "version": self.version,
        "staleness": self.staleness, "initial_val_loss": self.initial_val_loss,
        "last_eval": self._last_eval,
        "next_eval": None if self._next_eval == math.inf else self._next_eval,
        "next_checkpoint": self._next_checkpoint,
        "clock": self.step_clock.get_state(),
        "iterators": [iterator.get_state() for iterator in self.iterators],
        "wall_seconds": self._wall_before + time.perf_counter() - self._wall_start}
    return arrays, meta

  def state_template(self, meta: dict[str, Any]) -> dict[str, Any]:
    """The abstract arrays of a ``state()`` with this ``meta`` (for restoring)."""
    worker = jax.eval_shape(self.inner.start, self.params)
    stacked = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((self.config.num_workers, *x.shape), x.dtype), worker)
    workers = {None: None, "ddp": worker, "rounds": stacked,
               "async": [worker] * self.config.num_workers}[meta["phase"]]
    return {"params": self.params, "outer_state": self.outer_state,
            "key": jax.random.key_data(self.key), "workers": workers,
            "pending": [self.params] * len(meta["jobs"])}

  def load_state(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
    """Continues from a ``state()`` of a run with the same config."""
    self.server.set(arrays["params"], arrays["outer_state"])
    self.key = jax.random.wrap_key_data(arrays["key"])
    self.workers = arrays["workers"]
    self.jobs = {w: _Job(delta, version, tokens, finish)
                 for (w, version, tokens, finish), delta in zip(meta["jobs"], arrays["pending"])}
    self.phase, self.ddp_remaining = meta["phase"], meta["ddp_remaining"]
    self.arrivals = list(meta["arrivals"])
    self.tokens, self.sim_time, self.version = meta["tokens"], meta["sim_time"], meta["version"]
    self.staleness = list(meta["staleness"])
    self.initial_val_loss, self._last_eval = meta["initial_val_loss"], meta["last_eval"]
    self._next_eval = math.inf if meta["next_eval"] is None else meta["next_eval"]
    self._next_checkpoint = meta["next_checkpoint"]
    self.step_clock.set_state(meta["clock"])
    for iterator, position in zip(self.iterators, meta["iterators"], strict=True):
      iterator.set_state(position)
    self._wall_before = meta["wall_seconds"]

  def _maybe_checkpoint(self) -> None:
    """Calls the checkpoint hook when the update count reaches the next multiple."""
    every = self.config.checkpoint_every
    if every <= 0 or self.version < self._next_checkpoint:
      return
    self._next_checkpoint = (self.version // every + 1) * every
    self._flush()  # the checkpoint's rows are all written before it
    if self._on_checkpoint is not None:
      self._on_checkpoint(self)

  # ------------------------------------------------------------------ helpers

  def _emit(self, row: Row) -> None:
    """Queues ``row``; arrival rows are fetched ``metrics_fetch_every`` at a time."""
    self._unfetched.append(row)
    if row["event"] != "arrival" or len(self._unfetched) >= self.config.metrics_fetch_every:
      self._flush()

  def _flush(self) -> None:
    """Fetches the queued rows' device scalars (one transfer) and hands the rows on."""
    rows, self._unfetched = server_lib.to_host(self._unfetched), []
    for row in rows:
      self.rows.append(row)
      self._on_row(row)

  def _evaluate(self, force: bool = False) -> None:
    """An eval row when the token count has passed the next eval point (or forced)."""
    if not force and self.tokens < self._next_eval:
      return
    every = self.config.eval_every_tokens
    self._next_eval = (self.tokens // every + 1) * every if every > 0 else math.inf
    row = {"event": "eval", "tokens": self.tokens, "sim_time": self.sim_time,
           "outer_updates": self.version}
    row.update(self.evaluator.as_metrics(self.params))
    self._last_eval = row
    self._emit(row)

  def _batches(self, worker: int, steps: int) -> np.ndarray:
    """Worker ``worker``'s next ``steps`` batches, (steps, batch, context + 1) on the host."""
    return np.stack([next(self.iterators[worker]) for _ in range(steps)])

  def _compute(self, worker: int) -> Any:
    """``worker``'s pending Δ, running its deferred inner steps first if needed."""
    job = self.jobs[worker]
    if job.work is not None:
      self.workers[worker], job.delta = job.work()
      job.work = None
    return job.delta

  def _next_key(self) -> jax.Array:
    self.key, key = jax.random.split(self.key)
    return key

  def _over_budget(self, tokens: int, sim_time: float) -> bool:
    budget = self.config.budget
    return ((budget.tokens > 0 and tokens > budget.tokens)
            or (budget.sim_seconds > 0 and sim_time > budget.sim_seconds))

  def _faulty(self, worker: int) -> bool:
    """Counts ``worker``'s arrival; True if the fault switch poisons this one.

    ``fault.kill_worker`` (``runtime=ray``) kills that worker's actor at its
    ``fault.arrival``-th arrival instead.
    """
    self.arrivals[worker] += 1
    fault = self.config.fault
    if fault.kill_worker == worker and fault.arrival == self.arrivals[worker]:
      self.placement.kill_worker(worker)
    return fault.worker == worker and fault.arrival == self.arrivals[worker]

  def _reject(self, worker: int, reason: str, staleness: int) -> None:
    self._emit({"event": "rejected", "worker": worker, "reason": reason,
                "staleness": staleness, "sim_time": self.sim_time,
                "outer_updates": self.version})

  # ----------------------------------------------------------------- runtimes

  async def run(self, on_row: Optional[Callable[[Row], None]] = None,
                on_checkpoint: Optional[Callable[["Simulation"], None]] = None) -> dict[str, Any]:
    """Runs (or, after ``load_state``, continues) until a budget ends.

    Args:
      on_row: called with every metrics row as it is emitted.
      on_checkpoint: called with the simulation every ``checkpoint_every``
        outer updates, at a point where ``state()`` is the whole run state.

    Returns:
      The summary (DESIGN.md, summary.json); ``wall_seconds`` adds up the
      wall time of every resumed part.
    """
    if on_row is not None:
      self._on_row = on_row
    self._on_checkpoint = on_checkpoint
    self._wall_start = time.perf_counter()
    self._real_start = self._wall_start - self.sim_time  # runtime=devices: time is real
    if self.phase is None:
      self._evaluate(force=True)
      self.initial_val_loss = self._last_eval["val_loss"]
    if self.method.synchrony == "async":
      await self._run_async()
    elif self.method.synchrony == "round":
      await self._run_rounds()
    else:
      await self._run_ddp(steps=None)
    self._flush()
    if self._last_eval["tokens"] != self.tokens or self._last_eval["sim_time"] != self.sim_time:
      self._evaluate(force=True)
    wall = self._wall_before + time.perf_counter() - self._wall_start
    return {"method": self.config.method, "seed": self.config.seed, "tokens": self.tokens,
            "sim_time": self.sim_time, "outer_updates": self.version,
            "initial_val_loss": self.initial_val_loss,
            "final_val_loss": self._last_eval["val_loss"],
            "mean_staleness": float(np.mean(self.staleness)) if self.staleness else 0.0,
            "wall_seconds": wall, "tokens_per_second": self.tokens / wall,
            "num_params": self.num_params}

  def close(self) -> None:
    """Releases the runtime's resources (``runtime=ray``: its actors); θ is gone after."""
    self.placement.close()

  def _real_time(self) -> float:
    """Seconds of real time this run has trained (all resumed parts together).

    Across processes (jax.distributed) process 0's clock, so that every
    process takes the same budget decisions.
    """
    return self.placement.agree(time.perf_counter() - self._real_start)

  async def _run_async(self) -> None:
    config, k = self.config, self.config.num_workers
    steps = (clock.dylu_steps(self.seconds, config.inner_steps) if config.dylu
             else np.full(k, config.inner_steps))
    message = self.comm.message_seconds(self.model_bytes)
    real = self.placement.real_clock
    queue = self.placement.arrivals(self._real_time, self._emit) if real else _SimulatedArrivals()

    def dispatch(worker: int, now: float) -> None:
      position = (self.iterators[worker].get_state() if self.placement.reads_own_data
                  else None)
      work = functools.partial(
          self.placement.run_worker, worker, self.workers[worker], self.server.dispatch_point(),
          self._batches(worker, int(steps[worker])), self._next_key(), position)
      # Simulated: message + compute + message, computed lazily (module docstring). Real
      # devices: the dispatch time (the queue takes arrivals when the devices finish them).
      finish = now if real else (
          now + message + self.step_clock.duration(worker, int(steps[worker])) + message)
      self.jobs[worker] = _Job(None, self.version, int(steps[worker]) * self.tokens_per_step,
                               finish, work)
      if real:
        self._compute(worker)
      queue.push(worker, self.jobs[worker])

    for worker in sorted(self.jobs, key=lambda w: (self.jobs[w].finish, w)):  # restored jobs
      queue.push(worker, self.jobs[worker])
    if self.phase is None:
      self.phase, self.workers = "async", [None] * k
      for worker in range(k):
        dispatch(worker, 0.0)
    try:
      await self._async_loop(queue, dispatch)
    finally:
      queue.close()

  async def _async_loop(self, queue, dispatch: Callable[[int, float], None]) -> None:
    """Takes arrivals from ``queue`` until it is empty or a budget ends."""
    config = self.config
    lazy = not self.placement.real_clock
    while len(queue):
      now, group = await queue.pop(config.grace_window)
      tokens = self.tokens + sum(self.jobs[w].tokens for w in group)
      if self._over_budget(tokens, now):
        break  # this group and everything still in flight are discarded, never computed
      for w in group:
        self._compute(w)
      arrived = [self.jobs.pop(w) for w in group]
      self.tokens, self.sim_time = tokens, now
      taus = [self.version - job.version for job in arrived]
      poisons = [config.fault.value if self._faulty(w) else None for w in group]
      results = self.server.update(taus, poisons, *(job.delta for job in arrived), fetch=False)
      for w, tau, result in zip(group, taus, results):
        if result["reason"] is not None:
          self._reject(w, result["reason"], tau)
          self.workers[w] = self.placement.fresh_moments(self.workers[w])
      if any(result["reason"] is None for result in results):
        self.version += 1
      for w, tau, result in zip(group, taus, results):
        if result.pop("reason") is None:
          self.staleness.append(tau)
          self._emit({"event": "arrival", "worker": w, "staleness": tau, "sim_time": now,
                      "outer_updates": self.version, **result})
      self._evaluate()
      for w in group:
        dispatch(w, now)
      if lazy and len(queue):  # the next arrival computes while the host goes on,
        head = self.jobs[queue.head()]  # unless the budget will discard it
        if not self._over_budget(self.tokens + head.tokens, head.finish):
          self._compute(queue.head())
      self._maybe_checkpoint()
      await asyncio.sleep(0)

  async def _run_rounds(self) -> None:
    config, k, h = self.config, self.config.num_workers, self.config.inner_steps
    palsgd = self.method.inner == "palsgd"
    if palsgd and self.phase in (None, "ddp"):
      warmup = h if config.palsgd_warmup_steps < 0 else config.palsgd_warmup_steps
      if warmup:
        warm = await self._run_ddp(steps=warmup)
        if self._over_budget(self.tokens, self.sim_time):
          return
        # The first round continues the warm-up's step count and AdamW moments.
        self.workers = _stack_copies(warm, k)
    self.phase = "rounds"
    allreduce = self.comm.allreduce_seconds(self.model_bytes, k)
    while True:
      # Every worker restarts from θ, keeping its own step count (and its AdamW
      # moments unless reset_optimizer).
      theta = self.placement.to_rounds(self.params)
      starts = self.inner.start_many(theta, self.workers, k)
      batches = np.stack([self._batches(i, h) for i in range(k)])
      keys = jnp.stack([self._next_key() for _ in range(k)])
      states, metrics = self.placement.run_round(starts, batches, keys, theta if palsgd else None)
      # PALSGD: pseudo-sync steps read no tokens and cost no compute time.
      real_steps = h - self.placement.to_host(metrics.pseudo_sync).sum(axis=1)
      tokens = self.tokens + int(real_steps.sum()) * self.tokens_per_step
      if self.placement.real_clock:  # the fetch above waited for the round
        duration = self._real_time() - self.sim_time
      else:
        duration = (max(self.step_clock.duration(i, int(real_steps[i])) for i in range(k))
                    + allreduce)
      if self._over_budget(tokens, self.sim_time + duration):
        return
      self.tokens, self.sim_time = tokens, self.sim_time + duration
      for i in range(k):
        if self._faulty(i):
          states = states._replace(
              params=server_lib.poison(states.params, config.fault.value, worker=i))
      reasons = server_lib.reasons(*map(self.placement.to_host,
                                        server_lib.nonfinite(states.params, per_worker=True)))
      accepted = np.array([reason is None for reason in reasons])
      for i, reason in enumerate(reasons):
        if reason is not None:
          self._reject(i, reason, 0)
      if not accepted.all():
        states = self.inner.reset_moments(states, self.placement.to_rounds(~accepted))
      self.workers = states
      if accepted.any():
        self.server.apply(self.placement.round_delta(self.params, states.params, accepted), 0)
        self.version += 1
      self._evaluate()
      self._maybe_checkpoint()
      await asyncio.sleep(0)

  async def _run_ddp(self, steps: Optional[int]) -> inner_lib.InnerState:
    """DDP steps in chunks of H (all of the budget when ``steps`` is None)."""
    config, k = self.config, self.config.num_workers
    allreduce = self.comm.allreduce_seconds(self.model_bytes, k)
    step_tokens = k * self.tokens_per_step
    if self.phase != "ddp":
      self.phase, self.workers = "ddp", self.inner.start(self.params)
      self.ddp_remaining = steps
    while self.ddp_remaining is None or self.ddp_remaining > 0:
      chunk = config.inner_steps if self.ddp_remaining is None else min(config.inner_steps,
                                                                         self.ddp_remaining)
      if config.budget.tokens > 0:
        chunk = min(chunk, (config.budget.tokens - self.tokens) // step_tokens)
      if chunk <= 0 or (self.placement.real_clock and config.budget.sim_seconds > 0
                        and self._real_time() >= config.budget.sim_seconds):
        break
      step_seconds = [max(self.step_clock.duration(i, 1) for i in range(k)) + allreduce
                      for _ in range(chunk)]
      if config.budget.sim_seconds > 0 and not self.placement.real_clock:
        # only the steps that end within the budget
        ends = self.sim_time + np.cumsum(step_seconds)
        chunk = int(np.sum(ends <= config.budget.sim_seconds))
        step_seconds = step_seconds[:chunk]
        if chunk == 0:
          break
      # Averaging K workers' gradients = one step on their K batches together.
      batches = np.concatenate([self._batches(i, chunk) for i in range(k)], axis=1)
      self.workers = self.placement.run_ddp(self.workers, batches, self._next_key())
      self.params = self.placement.to_server(jax.tree.map(jnp.array, self.workers.params))
      if self.placement.real_clock:
        jax.block_until_ready(self.params)
        step_seconds = [self._real_time() - self.sim_time]
      self.version += chunk
      self.tokens += chunk * step_tokens
      self.sim_time += sum(step_seconds)
      if self.ddp_remaining is not None:
        self.ddp_remaining -= chunk
      self._evaluate()
      self._maybe_checkpoint()
      await asyncio.sleep(0)
    return self.workers


def simulate(config: ml_collections.ConfigDict, dataset: Optional[data_lib.Data] = None,
             on_row: Optional[Callable[[Row], None]] = None) -> tuple[dict[str, Any], list[Row]]:
  """Runs ``config`` on the simulated clock; returns (summary, metrics rows).

  Inside a running event loop (a Jupyter kernel) ``asyncio.run`` is not
  allowed: there, ``simulation = Simulation(config)``, ``summary = await
  simulation.run()`` and ``simulation.rows`` do the same.
  """
  try:
    asyncio.get_running_loop()
  except RuntimeError:
    pass
  else:
    raise RuntimeError("simulate() cannot run inside a running event loop (e.g. a Jupyter "
                       "kernel); use `simulation = Simulation(config); summary = await "
                       "simulation.run()` and `simulation.rows` instead.")
  simulation = Simulation(config, dataset)
  summary = asyncio.run(simulation.run(on_row))
  return summary, simulation.rows
