"""A run's parts: its spec and budget, state, streams, rows, and the ``Run`` the loops take.

``RunSpec`` (with its ``Budget``) says what a run is; ``RunState`` holds the
engine's counters and ``Features`` each feature's own state (each a checkpoint
entry: ``entry_of``, ``arrays_of``, ``load_entry``); ``WorkerStream``
reads a worker's batches and can save and restore its position;
``Recorder`` keeps the metrics rows, fetching their device scalars in
batches. ``Run`` holds all of them with the runtime's parts (executor, clock)
and the server: what the loops (``runtime.loops``) read and change.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Optional

import jax
import numpy as np

from heloco_jax.comm import cost
from heloco_jax.comm import downlink as downlink_lib
from heloco_jax.comm import fragments as fragments_lib
from heloco_jax.comm import syncer as syncer_lib
from heloco_jax.comm import uplink as uplink_lib
from heloco_jax.runtime import base
from heloco_jax.runtime import streaming as streaming_lib
from heloco_jax.training import checks
from heloco_jax.training import membership as membership_lib
from heloco_jax.training import methods as methods_lib
from heloco_jax.training import rejection as rejection_lib
from heloco_jax.training import server as server_lib

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
class RunSpec:
  """Everything about a run except the problem and the runtime.

  Attributes:
    method: the registry entry (``heloco_jax.training.methods.METHODS[name]``).
    num_workers: K.
    inner_steps: H.
    seconds_per_step: per worker, simulated seconds per inner step.
    jitter: relative per-step jitter of the simulated clock, in [0, 1).
    comm: message and all-reduce costs.
    dylu: H_i = max(1, ⌊v_i/v_ref·H⌋) (asynchronous methods).
    syncer: how arrivals are grouped and merged (``heloco_jax.comm.syncer.Syncer``).
    membership: when workers leave and join (``heloco_jax.training.membership.Membership``).
    palsgd_warmup_steps: DDP steps before PALSGD's rounds; None = H.
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
    fragments: P, θ's fragments, each synced every H steps at offset p·H/P
      (ALGORITHMS.md, "Fragments"); 1: θ syncs as a whole.
    fragment_layout: how leaves are split (``heloco_jax.comm.fragments.split``).
    overlap_steps: τ, inner steps a worker takes while a fragment's sync is in
      flight (with fragments).
    fragment_alpha: α, the weight of the arrived fragment against the local one.
    seed: PRNG seed of dispatch keys and the clock's jitter.
  """
  method: methods_lib.Method
  num_workers: int
  inner_steps: int
  seconds_per_step: tuple[float, ...]
  jitter: float = 0.0
  comm: cost.CommModel = cost.CommModel()
  dylu: bool = False
  syncer: syncer_lib.Syncer = syncer_lib.Syncer()
  membership: membership_lib.Membership = membership_lib.Membership()
  palsgd_warmup_steps: Optional[int] = None
  budget: Budget = Budget()
  eval_every: int = 0
  units_per_step: int = 1
  unit: str = "steps"
  checkpoint_every: int = 0
  rejection_limit: int = 0
  palsgd_coins: str = "shared"
  metrics_fetch_every: int = 16
  fragments: int = 1
  fragment_layout: Any = "contiguous"
  overlap_steps: int = 0
  fragment_alpha: float = 1.0
  seed: int = 0

  @property
  def streaming(self) -> bool:
    """θ syncs fragment by fragment (``runtime.loops``' streaming path)."""
    return self.fragments > 1


class WorkerStream:
  """One worker's batches, with a position a checkpoint can save and restore.

  Iterators with ``get_state``/``set_state`` (grain's) save their own
  position; for any other iterable the count of batches read is saved, and a
  restore iterates ``source`` anew and skips that many. Every batch must have
  the structure and shapes of the run's first batch (``first``, shared by
  the workers' streams): a mismatch is an error naming the worker and batch.

  Args:
    source: the worker's iterable of batches.
    worker: its index (error messages).
  """

  def __init__(self, source: Iterable[Any], worker: int = 0):
    self._source = source
    self.worker = worker
    self._iterator = source if hasattr(source, "get_state") else iter(source)
    self._read = 0
    self._peeked: list[Any] = []
    # The run's first batch and its signature, shared by all streams (``share_first_batch``).
    self.first: list[Any] = []

  def _next_batch(self) -> Any:
    if self._peeked:
      return self._peeked.pop()
    try:
      batch = next(self._iterator)
    except StopIteration:
      raise ValueError(f"worker {self.worker}'s data ran out after {self._read} batches; "
                       "allowed: iterables that yield a batch for every inner step of the run "
                       "(e.g. endless iterators, or a budget that fits the data)") from None
    if batch is None or not jax.tree.leaves(batch):
      raise ValueError(f"worker {self.worker}'s batch {self._read} is {batch!r}; allowed: a "
                       "pytree of arrays (e.g. a tuple (x, y) or a dict)")
    return batch

  def peek(self) -> Any:
    """The next batch, without consuming it (``make_engine``'s checks of ``loss_fn``)."""
    if not self._peeked:
      self._before_peek = self._position()
      self._peeked.append(self._next_batch())
    return self._peeked[0]

  def next(self, steps: int) -> Any:
    """The next ``steps`` batches, stacked on a new leading axis (leaf by leaf)."""
    batches = []
    for _ in range(steps):
      batch = self._next_batch()
      if not self.first:
        self.first.append((batch, _signature(batch)))
      elif _signature(batch) != self.first[0][1]:  # the message names the worker and leaf
        checks.check_batch(self.worker, self._read, batch, self.first[0][0])
      batches.append(batch)
      self._read += 1
    return jax.tree.map(lambda *xs: np.stack(xs), *batches)

  def _position(self) -> Any:
    if hasattr(self._iterator, "get_state"):
      return self._iterator.get_state()
    return {"batches_read": self._read}

  def get_state(self) -> Any:
    """The stream's position; a peeked batch not read yet is read again after a restore (a
    worker that joins later still holds the batch its checks peeked)."""
    return self._before_peek if self._peeked else self._position()

  def set_state(self, state: Any) -> None:
    self._peeked.clear()
    if hasattr(self._iterator, "set_state"):
      self._iterator.set_state(state)
      return
    if self._iterator is self._source:
      raise ValueError(f"cannot resume worker {self.worker}'s data: it is a one-shot "
                       "iterator; allowed: a re-iterable (e.g. a list or a grain dataset) or "
                       "an iterator with get_state/set_state")
    self._iterator, self._read = iter(self._source), 0
    for _ in range(state["batches_read"]):
      next(self._iterator)
      self._read += 1


def _signature(batch: Any) -> tuple:
  """A batch's structure and its leaves' shapes and dtypes."""
  leaves, treedef = jax.tree.flatten(batch)
  return treedef, tuple((np.shape(x), np.result_type(x)) for x in leaves)


def share_first_batch(streams: list[WorkerStream]) -> None:
  """Makes the streams check every batch against the first batch any of them reads."""
  first: list[Any] = []
  for stream in streams:
    stream.first = first


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
class RunState:
  """The engine's own counters: where the run stands and the loop's position.

  ``phase`` says which loop runs (None before the first, "ddp", "rounds",
  "async"); ``workers`` holds the workers' inner states (the checkpoint's
  "workers" arrays) and ``jobs`` the work in flight. Each feature keeps its own
  state (``Features``).
  """
  units: int = 0
  sim_time: float = 0.0
  version: int = 0
  staleness: list = dataclasses.field(default_factory=list)
  phase: Optional[str] = None
  ddp_remaining: Optional[int] = None
  next_checkpoint: int = 0
  wall_before: float = 0.0
  workers: Any = dataclasses.field(default=None, metadata={"array": "workers"})
  jobs: dict = dataclasses.field(default_factory=dict, metadata={"jobs": True})

  def restored(self) -> None:
    self.staleness = list(self.staleness)


@dataclasses.dataclass
class EvaluationState:
  """The evaluations so far (a checkpoint's "evaluation" entry): the first and the last
  row, and the units at which the next one is due (inf: none before the end)."""
  initial_eval: Row = dataclasses.field(default_factory=dict)
  last_eval: Row = dataclasses.field(default_factory=dict)
  next_eval: float = 0

  def restored(self) -> None:
    self.next_eval = math.inf if self.next_eval is None else self.next_eval  # JSON has no inf


@dataclasses.dataclass
class Traffic:
  """The transfers of the work that reached the server (a checkpoint's "traffic" entry;
  docs/DESIGN.md, summary.json): bytes in all, the most in one outer update, and simulated
  seconds on the network."""
  bytes_sent: int = 0
  peak_bytes_per_sync: int = 0
  network_seconds: float = 0.0

  def sync(self, bytes_moved: int, network_seconds: Optional[float]) -> None:
    """Counts one outer update's transfers (``network_seconds`` None: not known)."""
    self.bytes_sent += bytes_moved
    self.peak_bytes_per_sync = max(self.peak_bytes_per_sync, bytes_moved)
    self.network_seconds += network_seconds or 0.0


@dataclasses.dataclass
class ReplayState:
  """The honest Δ that replaying faulty workers (``W:replay=N``; ``runtime.faults``) hold,
  oldest first, N at most per worker: a feature's checkpoint entry (``queued``: [worker, how
  many] per worker) and its arrays (``held``, the queues one after the other)."""
  queued: list = dataclasses.field(default_factory=list)
  held: Optional[list] = dataclasses.field(default=None, metadata={"array": "replayed"})

  def send(self, worker: int, n: int, delta: Any) -> Any:
    """What ``worker`` sends in place of its honest ``delta``, its k-th: its Δ_{max(0, k−n)}."""
    queues, held = {}, iter(self.held or ())
    for w, count in self.queued:
      queues[w] = [next(held) for _ in range(count)]
    queue = queues.setdefault(worker, [])
    queue.append(delta)
    sent = queue[0]
    if len(queue) > n:
      queue.pop(0)
    self.queued = [[w, len(q)] for w, q in sorted(queues.items())]
    self.held = [d for _, q in sorted(queues.items()) for d in q]
    return sent

  def template(self, meta: dict[str, Any], delta: Any) -> dict[str, Any]:
    """The abstract arrays of a checkpoint with this entry (``meta``), each Δ like ``delta``."""
    count = sum(n for _, n in meta.get("queued", ()))
    return {"replayed": [delta] * count} if count else {}


@dataclasses.dataclass
class Features:
  """Each feature's own state, restored from the checkpoint entry of its field's name
  (docs/DESIGN.md, "Checkpoints"); its arrays go under their field's ``metadata["array"]``."""
  rejection: rejection_lib.RejectionState = dataclasses.field(
      default_factory=rejection_lib.RejectionState)
  traffic: Traffic = dataclasses.field(default_factory=Traffic)
  streaming: streaming_lib.StreamingState = dataclasses.field(
      default_factory=streaming_lib.StreamingState)
  syncer: syncer_lib.SyncerState = dataclasses.field(default_factory=syncer_lib.SyncerState)
  membership: membership_lib.MembershipState = dataclasses.field(
      default_factory=membership_lib.MembershipState)
  compression: uplink_lib.CompressionState = dataclasses.field(
      default_factory=uplink_lib.CompressionState)
  downlink: downlink_lib.DownlinkState = dataclasses.field(
      default_factory=downlink_lib.DownlinkState)
  evaluation: EvaluationState = dataclasses.field(default_factory=EvaluationState)
  replay: ReplayState = dataclasses.field(default_factory=ReplayState)

  def items(self) -> list[tuple[str, Any]]:
    return [(field.name, getattr(self, field.name)) for field in dataclasses.fields(self)]


def entry_of(state: Any) -> dict[str, Any]:
  """A state's JSON fields (its checkpoint entry): every field but its arrays and jobs;
  inf as None (JSON has no inf)."""
  return {f.name: None if getattr(state, f.name) == math.inf else getattr(state, f.name)
          for f in dataclasses.fields(state) if not f.metadata}


def arrays_of(state: Any) -> dict[str, Any]:
  """A state's arrays by their checkpoint name (None: not saved)."""
  return {f.metadata["array"]: getattr(state, f.name) for f in dataclasses.fields(state)
          if "array" in f.metadata and getattr(state, f.name) is not None}


def load_entry(state: Any, entry: dict[str, Any], arrays: dict[str, Any]) -> None:
  """Sets ``state`` from its checkpoint entry and arrays (fields added since the checkpoint
  was written keep their defaults), then calls its ``restored`` hook if it has one."""
  for f in dataclasses.fields(state):
    if "array" in f.metadata:
      setattr(state, f.name, arrays.get(f.metadata["array"]))
    elif not f.metadata and f.name in entry:
      setattr(state, f.name, entry[f.name])
  if hasattr(state, "restored"):
    state.restored()


@dataclasses.dataclass
class Run:
  """A run's state and its services: what the loops (``runtime.loops``) take.

  Attributes:
    spec: the ``RunSpec``.
    executor: where work runs (``base.Executor``).
    clock: the run's clock.
    arrivals: builds the queue of asynchronous work in flight.
    server: θ, the outer state and the outer rule (``server.OuterServer``).
    uplink: how Δ reaches the server (``Uplink``).
    fragments: θ's split (``heloco_jax.comm.fragments.Fragments``; one fragment: θ).
    streams: the K workers' ``WorkerStream``s.
    recorder: the metrics rows.
    state: the engine's counters (``RunState``).
    features: each feature's own state (``Features``).
    key: the run's PRNG key stream.
    model_states: the server's copy of the model state and the workers' keys
      (``heloco_jax.training.model_state``; inactive for a plain ``loss_fn``).
    downlink: how θ reaches a worker compressed (``heloco_jax.comm.downlink.Downlink``);
      None: θ as it is.
  """
  spec: RunSpec
  executor: Any
  clock: Any
  arrivals: Callable[[], Any]
  server: Any
  uplink: uplink_lib.Uplink
  fragments: fragments_lib.Fragments
  streams: list[WorkerStream]
  recorder: Recorder
  state: RunState
  features: Features
  key: jax.Array
  model_states: Any = None
  downlink: Optional[downlink_lib.Downlink] = None

  def batches(self, worker: int, steps: int) -> Any:
    """Worker ``worker``'s next ``steps`` batches, stacked on a leading axis."""
    return self.streams[worker].next(steps)

  def next_key(self) -> jax.Array:
    """A fresh PRNG key of the run's key stream."""
    self.key, key = jax.random.split(self.key)
    return key

  def compute(self, worker: int) -> Any:
    """``worker``'s pending Δ as the server receives it, running its deferred inner steps
    (and compressing their Δ) first if needed."""
    job = self.state.jobs[worker]
    if job.work is not None:
      try:
        self.state.workers[worker], job.delta, job.train_loss = job.work()
      except base.SettingError:
        raise
      except (TypeError, ValueError) as error:  # tracing the user's loss_fn or inner_tx
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise type(error)(f"worker {worker}'s inner steps (dispatched at outer update "
                          f"{job.version}) failed in loss_fn or inner_tx: {first}") from error
      states = self.features.compression.states
      state = None if states is None else states[worker][job.fragment]
      job.delta, state = self.executor.transmit(self.uplink, job.fragment, job.delta, state)
      if states is not None:
        states[worker][job.fragment] = state
      job.work = None
    return job.delta

  def emit(self, row: Row) -> None:
    self.recorder.emit(row)

  def train_loss(self, loss: Any) -> dict[str, Any]:
    """A row's ``train_loss`` field: the mean loss of the inner steps it reports (none for a
    job restored from a checkpoint written before the loss was kept), and the means of the
    metrics ``loss_fn`` returned as ``train_<name>``."""
    loss = self.executor.fetch(loss, "train_loss")
    if isinstance(loss, dict):  # with loss_fn's metrics: train_loss and train_<name>
      return dict(loss)
    return {} if loss is None else {"train_loss": loss}

  def reject(self, worker: int, reason: str, staleness: int, units: int) -> None:
    """A ``rejected`` row for ``worker``'s pseudo-gradient of ``units`` units (non-finite, or
    refused by an aggregation screen: ``reason``)."""
    self.features.rejection.reject(units, reason)
    self.emit({"event": "rejected", "worker": worker, "reason": reason,
               "staleness": staleness, "sim_time": self.state.sim_time,
               "outer_updates": self.state.version})
