"""A run's parts besides the engine: its spec and budget, state, streams and rows.

``RunSpec`` (with its ``Budget`` and ``Fault``) says what a run is; ``RunState``
is the host side of where it stands (what a checkpoint's meta holds);
``WorkerStream`` reads a worker's batches and can save and restore its
position; ``Recorder`` keeps the metrics rows, fetching their device scalars
in batches.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Optional

import jax
import numpy as np

from heloco_jax import clock as clock_lib, methods as methods_lib, server as server_lib

Row = dict[str, Any]
PALSGD_COINS = ("shared", "independent")  # RunSpec.palsgd_coins


@dataclasses.dataclass(frozen=True)
class Budget:
  """Where a run ends: work whose arrival would pass a budget is discarded.

  Attributes:
    units: 0 = none; else the units (``RunSpec.units_per_step`` per inner
      step whose result reached the server, applied or rejected) the run may
      not pass.
    sim_seconds: 0 = none; else the time (simulated, or real on real
      hardware) the run may not pass.
  """
  units: int = 0
  sim_seconds: float = 0.0

  def over(self, units: int, sim_time: float) -> bool:
    """Whether work ending at (units, sim_time) passes a budget."""
    return ((self.units > 0 and units > self.units)
            or (self.sim_seconds > 0 and sim_time > self.sim_seconds))

  def units_left(self, units: int, per_step: int, steps: int) -> int:
    """How many of ``steps`` steps of ``per_step`` units fit after ``units``."""
    return steps if self.units <= 0 else min(steps, (self.units - units) // per_step)


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
    budget: where the run ends (``Budget``).
    eval_every: units between evaluations (0 = at the start and end only).
    units_per_step: units one inner step of one worker counts.
    unit: the name of the unit in rows and the summary ("steps", "tokens").
    checkpoint_every: outer updates between checkpoint hooks (0 = off).
    rejection_limit: pseudo-gradients rejected in a row that stop the run
      (``DivergenceError``); 0 = K, at least 2.
    palsgd_coins: "shared" (every worker of a round gets the same PRNG key, so
      all pseudo-sync on the same steps, as the PALSGD authors' code) or
      "independent" (a key per worker).
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
  budget: Budget = Budget()
  eval_every: int = 0
  units_per_step: int = 1
  unit: str = "steps"
  checkpoint_every: int = 0
  rejection_limit: int = 0
  palsgd_coins: str = "shared"
  metrics_fetch_every: int = 16
  seed: int = 0
  fault: Fault = Fault()


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
  """The run's metrics rows: arrival and train rows' device scalars fetched in batches.

  Args:
    fetch_every: arrival and train rows queued before one device-to-host transfer.
  """

  def __init__(self, fetch_every: int):
    self.fetch_every = fetch_every
    self.rows: list[Row] = []
    self.on_row: Callable[[Row], None] = lambda row: None
    self._unfetched: list[Row] = []

  def emit(self, row: Row) -> None:
    """Queues ``row``; arrival and train rows are fetched ``fetch_every`` at a time."""
    self._unfetched.append(row)
    if row["event"] not in ("arrival", "train") or len(self._unfetched) >= self.fetch_every:
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
  (end state, Δ, mean training loss) from the inputs fixed at dispatch
  (simulated clock).
  """
  delta: Any
  version: int
  units: int
  finish: float
  work: Optional[Callable[[], tuple[Any, Any, Any]]] = None
  train_loss: Any = None


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
  rejected: int = 0
  rejected_units: int = 0
  rejected_in_a_row: Any = 0
  initial_eval: Row = dataclasses.field(default_factory=dict)
  last_eval: Row = dataclasses.field(default_factory=dict)
  next_eval: float = 0
  next_checkpoint: int = 0
  wall_before: float = 0.0

  META = ("units", "sim_time", "version", "staleness", "phase", "ddp_remaining", "arrivals",
          "rejected", "rejected_units", "rejected_in_a_row", "initial_eval", "last_eval",
          "next_eval", "next_checkpoint", "wall_before")

  def meta(self) -> dict[str, Any]:
    """The JSON-serialisable fields (a checkpoint's meta)."""
    meta = {name: getattr(self, name) for name in self.META}
    meta["next_eval"] = None if self.next_eval == math.inf else self.next_eval
    meta["jobs"] = [[w, job.version, job.units, job.finish]
                    for w, job in sorted(self.jobs.items())]
    return meta

  def load(self, meta: dict[str, Any], pending: list[Any], workers: Any) -> None:
    for name in self.META:  # keys added since a checkpoint was written keep their defaults
      setattr(self, name, meta.get(name, getattr(self, name)))
    self.staleness, self.arrivals = list(self.staleness), list(self.arrivals)
    self.next_eval = math.inf if meta["next_eval"] is None else meta["next_eval"]
    # A job's entry: [worker, version, units, finish, train loss (absent before it was kept)].
    self.jobs = {entry[0]: Job(delta, *entry[1:4], train_loss=(entry + [None])[4])
                 for entry, delta in zip(meta["jobs"], pending)}
    self.workers = workers
