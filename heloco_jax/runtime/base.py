"""What a runtime is made of: where work runs, what time is, how arrivals are queued.

A ``Runtime`` (docs/DESIGN.md, "Runtimes") is a composition of three parts,
not a kind to branch on:

  * an ``Executor``: where work runs (this process's devices, groups of real
    devices, Ray actors). It declares the synchronies it can run
    (``synchronies``) and how many workers' steps run at once
    (``concurrency``).
  * a clock: ``SimulatedClock`` (deterministic simulated seconds; a
    dispatch's work is computed lazily) or ``RealClock`` (seconds since the
    run began; work starts at dispatch).
  * an arrival queue: ``SimulatedArrivals`` (by simulated finish time) or
    the devices' and Ray's queues (in the order the work finishes).

``hj.simulated_runtime()``, ``hj.devices_runtime(...)`` and
``hj.ray_runtime(...)`` (``heloco_jax.runtime.factories``) compose them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Optional, Protocol, Sequence, runtime_checkable

import jax
import numpy as np

from heloco_jax.comm import cost
from heloco_jax.training import inner as inner_lib

Row = dict[str, Any]
SYNCHRONIES = frozenset({"step", "round", "async"})


class SettingError(ValueError):
  """A runtime's setting does not fit the devices or data it meets (one line naming the key):
  raised as it is, never blamed on the user's ``loss_fn``."""


class Events(NamedTuple):
  """The membership events in an arrival queue (``heloco_jax.training.membership``): which
  entries are events, which of them bring work (a join), and their handler."""
  is_event: Callable[[int], bool]
  brings_work: Callable[[int], bool]
  handle: Callable[[int, float], None]


@dataclasses.dataclass
class Job:
  """A dispatched worker's result, waiting for its finish time.

  ``delta`` is None while the work is deferred: ``work`` then computes
  (end state, Δ, mean training loss) from the inputs fixed at dispatch
  (simulated clock). With fragments, Δ is that of ``fragment`` and ``version``
  the fragment's version when the worker last received it.
  """
  delta: Any
  version: int
  units: int
  finish: float
  work: Optional[Callable[[], tuple[Any, Any, Any]]] = None
  train_loss: Any = None
  fragment: int = 0


class Arrivals(Protocol):
  """Jobs in flight, taken in arrival order, in the groups of the syncer's rule
  (``heloco_jax.comm.syncer``): ``pop`` returns (when the group closes, its workers, their arrival
  times)."""

  def __len__(self) -> int: ...

  def push(self, worker: int, job: Any, leaves: float = math.inf) -> None:
    """Queues ``worker``'s ``job`` (a ``Job``; one without work, ``delta`` None and no
    ``work``: a membership event at ``job.finish``). On a real clock, ``leaves`` is when the
    worker leaves: its entry is taken then, at that time, unless its work arrived first (the
    simulated clock decides this at dispatch)."""

  async def pop(self, rule: Any, events: Optional["Events"] = None
                ) -> tuple[float, list[int], list[float]]: ...

  def heads(self, n: int) -> list[int]:
    """The workers of the next ``n`` arrivals, whose work a lazy clock starts ahead (a
    queue that learns the order only as work finishes returns [])."""

  def close(self) -> None: ...


@runtime_checkable
class Executor(Protocol):
  """Where a run's asynchronous work happens.

  Trees of worker states and pseudo-gradients handed back by ``run_worker``
  may be handles (Ray); ``fetch`` turns them into values.

  Attributes:
    inner: the workers' compiled inner loop.
    synchronies: what the executor runs: "async" always; "round" and "step"
      (synchronous methods) for a ``RoundExecutor``.
    concurrency: how many workers' steps can run at once.
    compresses: whether workers can compress their Δ (``compress=``); absent:
      they cannot.
    compresses_downloads: whether θ's downloads can be compressed
      (``compress=hj.Compression(down=...)``); absent: they cannot.
  """

  inner: inner_lib.InnerLoop
  synchronies: frozenset[str]
  concurrency: int

  def make_server(self, outer_tx: Any, params: Any, **options: Any) -> Any:
    """θ, the outer state and the jitted outer rule (``heloco_jax.training.server.OuterServer``)."""

  def make_downlink(self, compressor: Any, params: Any, server: Any, fragments: Any) -> Any:
    """How θ reaches a worker compressed (``heloco_jax.comm.downlink.Downlink``; ``fragments``:
    θ's split), from ``make_server``'s ``server``; only where ``compresses_downloads``."""

  def run_worker(self, worker: int, previous: Any, start: Any, batches: Any,
                 key: jax.Array, carry: bool = False) -> tuple[Any, Any, Any]:
    """Worker ``worker``'s inner steps from ``start``: (end state, Δ = start − end, the mean
    training loss of its steps). ``carry``: the end state as the next dispatch from θ reads
    it (``InnerLoop.carry``; docs/DESIGN.md, "Memory per worker")."""

  def run_fragment(self, worker: int, previous: Any, steps: Any, batches: Any,
                   key: jax.Array) -> tuple[Any, Any, Any]:
    """A fragment dispatch's work (``runtime.streaming.FragmentSteps``): (end state, Δ of its
    fragment, the mean training loss)."""

  def fresh_moments(self, state: Any) -> Any:
    """``state`` with a fresh inner optimizer state (its step count kept)."""

  def fetch(self, tree: Any, what: str) -> Any:
    """Worker states (``what="state"``), a pending Δ (``"delta"``) or a training loss
    (``"train_loss"``) as values."""

  def to_server(self, tree: Any) -> Any: ...
  def to_host(self, x: Any) -> np.ndarray: ...

  def transmit(self, uplink: Any, fragment: int, delta: Any, state: Any) -> tuple[Any, Any]:
    """A worker's Δ of fragment ``fragment`` as the server receives it, and the worker's next
    compressor state (``state``; None without a compressor): ``uplink`` (``comm.uplink``)."""

  def agree(self, value: float) -> float:
    """``value`` as every process sees it (process 0's)."""

  def describe(self) -> str:
    """Where the workers run, in words (the CLI's start line)."""

  def close(self) -> None:
    """Releases the executor's resources."""


@runtime_checkable
class RoundExecutor(Executor, Protocol):
  """An executor that also runs synchronous methods (rounds and DDP steps)."""

  def run_round(self, states: Any, batches: Any, keys: jax.Array,
                anchor: Any) -> tuple[Any, inner_lib.InnerMetrics]:
    """The K stacked workers' inner steps as one program."""

  def run_ddp(self, state: Any, batches: Any, key: jax.Array) -> tuple[Any, Any]:
    """DDP steps on the K workers' batches together: (state, their mean training loss)."""

  def round_delta(self, params: Any, ends: Any, accepted: np.ndarray) -> Any:
    """θ − the mean end parameters of the accepted workers, on the server."""

  def compressed_round_delta(self, uplink: Any, params: Any, ends: Any, accepted: np.ndarray,
                             states: Any) -> tuple[Any, Any]:
    """``round_delta`` with every worker's Δ compressed (``Uplink.round_delta``): (the mean
    received Δ on the server, the workers' next compressor states, stacked)."""

  def to_rounds(self, tree: Any) -> Any: ...


class Clock(Protocol):
  """Time as the engine sees it; ``SimulatedClock`` and ``RealClock`` implement it.

  Attributes:
    eager: start a dispatch's work at once (real hardware) or when it is needed.
    simulated: time is simulated (runs replay bit for bit) rather than real; a
      simulated clock also has ``download``, ``upload`` and ``allreduce``, the
      seconds of a dispatch's transfers and of a round's all-reduce.
  """

  eager: bool
  simulated: bool

  def start(self, elapsed: float) -> None: ...
  def finish(self, worker: int, steps: int, now: float,
             download_bytes: Optional[int] = None) -> float: ...
  def round_seconds(self, real_steps: np.ndarray, start: float) -> float: ...
  def fragment_arrival(self, worker: int, steps: int, now: float, received: Optional[int],
                       sent: int) -> float: ...
  def fragment_round_seconds(self, steps: int, fragment: int, start: float,
                             present: Optional[np.ndarray] = None) -> float: ...
  def plan_ddp(self, chunk: int, start: float, limit: float,
               workers: Optional[np.ndarray] = None) -> tuple[int, Optional[list]]: ...
  def ddp_seconds(self, planned: Optional[list], start: float, params: Any) -> float:
    """The seconds of the DDP steps ``planned`` (as the loop cut them) from ``start``;
    ``params``: θ after them, None when no worker computed them."""
  def ddp_exposed(self, planned: Optional[list], step: int) -> Optional[float]:
    """DDP step ``step``'s all-reduce seconds that its compute does not hide (None: not
    known)."""

  async def wait_until(self, t: float) -> None:
    """Returns when the clock reads ``t`` (a simulated clock at once: the engine sets its
    time); a synchronous loop waits so while every worker is away."""

  def get_state(self) -> Any: ...
  def set_state(self, state: Any) -> None: ...


@dataclasses.dataclass(frozen=True)
class ClockSettings:
  """What a clock is built from: the run's speeds, jitter, seed and costs."""
  seconds_per_step: np.ndarray
  jitter: float
  seed: int
  comm: cost.CommModel
  model_bytes: int
  # Per fragment: one worker's Δ on the wire, and the fragment's θ; None: θ as one fragment.
  upload_bytes: Optional[Sequence[int]] = None
  download_bytes: Optional[Sequence[int]] = None
  overlap_steps: int = 0


def link_of(settings: ClockSettings) -> cost.Link:
  """The run's link (``cost.Link``): the same bytes and seconds on either clock."""
  return cost.Link.of(settings.comm, len(settings.seconds_per_step), settings.model_bytes,
                      settings.upload_bytes, settings.download_bytes)


ClockFactory = Callable[[ClockSettings, Executor], Clock]
# (the run's clock, the executor, the row emitter) -> the queue of work in flight
ArrivalsFactory = Callable[[Clock, Executor, Callable[[Row], None]], Arrivals]


@dataclasses.dataclass(frozen=True)
class Runtime:
  """Where work runs × what time is × how arrivals are queued.

  Attributes:
    executor: where work runs (its ``synchronies`` say which methods it can run).
    clock: builds the run's clock from its ``ClockSettings`` and the executor.
    arrivals: builds the queue of asynchronous work in flight.
    features: run features (``state.Features`` fields by name) whose state a piece of the
      runtime owns, e.g. a faulty executor's replay queue (``runtime.faults``): the run takes
      them as its own, so a checkpoint keeps and restores them.
  """
  executor: Executor
  clock: ClockFactory
  arrivals: ArrivalsFactory
  features: dict[str, Any] = dataclasses.field(default_factory=dict)

  def describe(self) -> str:
    return self.executor.describe()

  def close(self) -> None:
    self.executor.close()
