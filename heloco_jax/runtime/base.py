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
import time
from typing import (Any, Callable, NamedTuple, Optional, Protocol, Sequence,
                    runtime_checkable)

import jax
import numpy as np

from heloco_jax import clock as clock_lib, inner as inner_lib

Row = dict[str, Any]
SYNCHRONIES = frozenset({"step", "round", "async"})


class Events(NamedTuple):
  """The membership events in an arrival queue (``heloco_jax.membership``; the simulated clock
  only): which entries are events, which of them bring work (a join), and their handler."""
  is_event: Callable[[int], bool]
  brings_work: Callable[[int], bool]
  handle: Callable[[int, float], None]


class Arrivals(Protocol):
  """Jobs in flight, taken in arrival order, in the groups of the syncer's rule
  (``heloco_jax.syncer``): ``pop`` returns (when the group closes, its workers, their arrival
  times)."""

  def __len__(self) -> int: ...
  def push(self, worker: int, job: Any) -> None: ...
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
  """

  inner: inner_lib.InnerLoop
  synchronies: frozenset[str]
  concurrency: int

  def make_server(self, outer_tx: Any, params: Any, **options: Any) -> Any:
    """θ, the outer state and the jitted outer rule (``heloco_jax.server.OuterServer``)."""

  def run_worker(self, worker: int, previous: Any, start: Any, batches: Any,
                 key: jax.Array) -> tuple[Any, Any, Any]:
    """Worker ``worker``'s inner steps from ``start``: (end state, Δ = start − end, the mean
    training loss of its steps)."""

  def fresh_moments(self, state: Any) -> Any:
    """``state`` with a fresh inner optimizer state (its step count kept)."""

  def fetch(self, tree: Any, what: str) -> Any:
    """Worker states (``what="state"``), a pending Δ (``"delta"``) or a training loss
    (``"train_loss"``) as values."""

  def to_server(self, tree: Any) -> Any: ...
  def to_host(self, x: Any) -> np.ndarray: ...

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

  def to_rounds(self, tree: Any) -> Any: ...


class OneProcess:
  """The transfers of an executor whose arrays all live in the engine's one process.

  θ needs no placing for the server or for a round, values are read as they
  are, and every process agrees with itself.
  """

  def to_server(self, tree: Any) -> Any:
    return tree

  def to_rounds(self, tree: Any) -> Any:
    return tree

  def to_host(self, x: Any) -> np.ndarray:
    return np.asarray(x)

  def agree(self, value: float) -> float:
    return value

  def fetch(self, tree: Any, what: str) -> Any:
    del what
    return tree


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
  def finish(self, worker: int, steps: int, now: float) -> float: ...
  def round_seconds(self, real_steps: np.ndarray, start: float) -> float: ...
  def plan_ddp(self, chunk: int, start: float, limit: float,
               workers: Optional[np.ndarray] = None) -> tuple[int, Optional[list]]: ...
  def ddp_seconds(self, planned: Optional[list], start: float, params: Any) -> float: ...
  def get_state(self) -> Any: ...
  def set_state(self, state: Any) -> None: ...


@dataclasses.dataclass(frozen=True)
class ClockSettings:
  """What a clock is built from: the run's speeds, jitter, seed and costs."""
  seconds_per_step: np.ndarray
  jitter: float
  seed: int
  comm: clock_lib.CommModel
  model_bytes: int
  # Per fragment: one worker's Δ on the wire, and the fragment's θ; None: θ as one fragment.
  upload_bytes: Optional[Sequence[int]] = None
  download_bytes: Optional[Sequence[int]] = None
  overlap_steps: int = 0


class SimulatedClock:
  """Deterministic simulated seconds (docs/ALGORITHMS.md, "Time and cost model").

  A dispatch takes θ's download + compute + Δ's upload (its compressed bytes);
  a round its slowest worker plus one ring all-reduce of the (compressed) Δ;
  a DDP step the slowest worker's step plus one all-reduce of the gradient,
  less what ``comm.ddp_overlap`` hides. Work is computed lazily (``eager`` False).

  With fragments (ALGORITHMS.md, "Fragments") a worker sends a fragment every
  H/P steps and, with overlap τ, keeps computing while it is in flight
  (``fragment_arrival``); a round's all-reduce hides behind τ steps.

  Attributes:
    download, upload: seconds of a dispatch's θ download and Δ upload.
    allreduce: seconds of a round's all-reduce.
    downloads, uploads, allreduces: the same per fragment.
  """

  eager = False
  simulated = True

  def __init__(self, settings: ClockSettings, executor: Executor):
    del executor
    self.steps = clock_lib.StepClock(settings.seconds_per_step, settings.jitter, settings.seed)
    self.num_workers = len(settings.seconds_per_step)
    comm, k = settings.comm, self.num_workers
    ups = settings.upload_bytes or [settings.model_bytes]
    downs = settings.download_bytes or [settings.model_bytes]
    self.uploads = [comm.message_seconds(b) for b in ups]
    self.downloads = [comm.message_seconds(b) for b in downs]
    self.allreduces = [comm.allreduce_seconds(b, k) for b in ups]
    self.download = comm.message_seconds(settings.model_bytes)
    self.upload, self.allreduce = self.uploads[0], self.allreduces[0]
    self.overlap_steps = settings.overlap_steps
    self._slowest = float(np.max(settings.seconds_per_step))
    self._model_bytes = settings.model_bytes
    self._ddp_allreduce = settings.comm.allreduce_seconds(settings.model_bytes, self.num_workers)
    self.comm = settings.comm

  def start(self, elapsed: float) -> None:
    del elapsed

  def finish(self, worker: int, steps: int, now: float) -> float:
    return now + self.download + self.steps.duration(worker, steps) + self.upload

  def round_seconds(self, real_steps: np.ndarray, start: float) -> float:
    del start
    return (max(self.steps.duration(i, int(real_steps[i])) for i in range(self.num_workers))
            + self.allreduce)

  def fragment_arrival(self, worker: int, steps: int, now: float, received: Optional[int],
                       sent: int) -> float:
    """When a worker's next fragment reaches the server (ALGORITHMS.md, "Fragments").

    The worker's last fragment arrived at ``now``; it then receives fragment
    ``received`` (None: all of θ, a first dispatch), takes ``steps`` inner
    steps (the first τ of them while the download is in flight, from when it
    sent its last fragment, ``now`` − that fragment's upload) and sends
    fragment ``sent``.
    """
    down = self.download if received is None else self.downloads[received]
    tau = min(self.overlap_steps, steps) if received is not None else 0
    if tau == 0:
      return now + down + self.steps.duration(worker, steps) + self.uploads[sent]
    sent_at = now - self.uploads[received]  # it sent `received`'s Δ then, and went on
    resume = max(sent_at + self.steps.duration(worker, tau), now + down)
    return resume + self.steps.duration(worker, steps - tau) + self.uploads[sent]

  def fragment_wait(self, worker: int, received: Optional[int], sent: int) -> float:
    """The seconds a worker waits on the network for one fragment sync (network_seconds):
    without overlap θ's or the fragment's download and the upload of what it sends; with
    overlap the round trip of the fragment less τ steps at the worker's nominal speed."""
    if received is None or self.overlap_steps == 0:
      down = self.download if received is None else self.downloads[received]
      return down + self.uploads[sent]
    return max(0.0, self.uploads[received] + self.downloads[received]
               - self.overlap_steps * float(self.steps.seconds[worker]))

  def exposed_allreduce(self, fragment: int) -> float:
    """The seconds of fragment ``fragment``'s all-reduce that the τ steps of the next round
    (at the slowest worker's speed) do not hide: all of it without overlap."""
    return max(0.0, self.allreduces[fragment] - self.overlap_steps * self._slowest)

  def fragment_round_seconds(self, steps: int, fragment: int) -> float:
    """A round of ``steps`` steps that ends in fragment ``fragment``'s exposed all-reduce."""
    compute = max(self.steps.duration(i, steps) for i in range(self.num_workers))
    return compute + self.exposed_allreduce(fragment)

  def plan_ddp(self, chunk: int, start: float, limit: float,
               workers: Optional[np.ndarray] = None) -> tuple[int, Optional[list]]:
    """(steps to run, their (seconds, exposed all-reduce seconds)): only the steps that end
    within ``limit`` (0 = none); of the ``workers`` present (booleans; default all)."""
    present = [i for i in range(self.num_workers) if workers is None or workers[i]]
    allreduce = (self._ddp_allreduce if len(present) == self.num_workers else
                 self.comm.allreduce_seconds(self._model_bytes, len(present)))
    computes = [max(self.steps.duration(i, 1) for i in present) for _ in range(chunk)]
    seconds = [self.comm.ddp_step_seconds(c, allreduce) for c in computes]
    if limit > 0:
      chunk = int(np.sum(start + np.cumsum(seconds) <= limit))
    return chunk, [(t, t - c) for t, c in zip(seconds[:chunk], computes[:chunk])]

  def ddp_seconds(self, planned: Optional[list], start: float, params: Any) -> float:
    del start, params
    return sum(t for t, _ in planned)

  def get_state(self) -> Any:
    return self.steps.get_state()

  def set_state(self, state: Any) -> None:
    self.steps.set_state(state)


class RealClock:
  """Seconds of real time the run has trained, all resumed parts together.

  Across processes (``jax.distributed``) process 0's clock, so that every
  process takes the same budget decisions. Work starts at dispatch.
  """

  eager = True
  simulated = False

  def __init__(self, settings: ClockSettings, executor: Executor):
    del settings  # real devices take real time
    self._agree = executor.agree
    self._start = time.perf_counter()

  def start(self, elapsed: float) -> None:
    self._start = time.perf_counter() - elapsed

  def now(self) -> float:
    return self._agree(time.perf_counter() - self._start)

  def finish(self, worker: int, steps: int, now: float) -> float:
    del worker, steps
    return now  # the arrivals queue reads the time when the devices finish

  def round_seconds(self, real_steps: np.ndarray, start: float) -> float:
    del real_steps
    return self.now() - start

  def plan_ddp(self, chunk: int, start: float, limit: float,
               workers: Optional[np.ndarray] = None) -> tuple[int, Optional[list]]:
    del start, workers
    return (0 if limit > 0 and self.now() >= limit else chunk), None

  def ddp_seconds(self, planned: Optional[list], start: float, params: Any) -> float:
    del planned
    jax.block_until_ready(params)
    return self.now() - start

  def get_state(self) -> Any:
    return None

  def set_state(self, state: Any) -> None:
    del state


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
  """
  executor: Executor
  clock: ClockFactory
  arrivals: ArrivalsFactory

  def describe(self) -> str:
    return self.executor.describe()

  def close(self) -> None:
    self.executor.close()
