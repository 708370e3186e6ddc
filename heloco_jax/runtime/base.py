"""What every runtime provides: the ``Runtime`` protocol and the two clocks.

A runtime decides *where* work runs (docs/DESIGN.md, "Runtimes"): the
simulated runtime on one device, ``devices`` on groups of real devices, ``ray``
on actors. The engine (``heloco_jax.runtime.engine``) drives all of them
through ``Runtime`` and reads time from the runtime's clock:
``SimulatedClock`` (deterministic simulated seconds, lazy work) or
``RealClock`` (seconds since the run began, work started at dispatch).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Protocol, runtime_checkable

import jax
import numpy as np

from heloco_jax import clock as clock_lib, inner as inner_lib

Row = dict[str, Any]


class Arrivals(Protocol):
  """Jobs in flight, taken in arrival order (with a grace window, in groups).

  Those of a lazy clock (``SimulatedArrivals``) also give ``heads(n)``, the
  workers of the next n arrivals, whose work the engine starts ahead.
  """

  def __len__(self) -> int: ...
  def push(self, worker: int, job: Any) -> None: ...
  async def pop(self, grace_window: float) -> tuple[float, list[int]]: ...
  def close(self) -> None: ...


@runtime_checkable
class Runtime(Protocol):
  """Where a run's work happens; implemented by the simulated, devices and Ray runtimes.

  Trees of worker states and pseudo-gradients handed back by ``run_worker``
  may be handles (Ray); ``fetch`` turns them into values.
  """

  inner: inner_lib.InnerLoop

  def make_clock(self, seconds_per_step: np.ndarray, jitter: float, seed: int,
                 comm: clock_lib.CommModel, model_bytes: int) -> "Clock":
    """The run's clock (simulated, or real for real hardware)."""

  def make_server(self, outer_tx: Any, params: Any, **options: Any) -> Any:
    """θ, the outer state and the jitted outer rule (``heloco_jax.server.OuterServer``)."""

  def arrivals(self, clock: "Clock", emit: Callable[[Row], None]) -> Arrivals:
    """The queue of asynchronous work in flight, read on ``clock``."""

  def run_worker(self, worker: int, previous: Any, start: Any, batches: Any,
                 key: jax.Array) -> tuple[Any, Any, Any]:
    """Worker ``worker``'s inner steps from ``start``: (end state, Δ = start − end, the mean
    training loss of its steps)."""

  def run_round(self, states: Any, batches: Any, keys: jax.Array,
                anchor: Any) -> tuple[Any, inner_lib.InnerMetrics]:
    """The K stacked workers' inner steps as one program."""

  def run_ddp(self, state: Any, batches: Any, key: jax.Array) -> tuple[Any, Any]:
    """DDP steps on the K workers' batches together: (state, their mean training loss)."""

  def round_delta(self, params: Any, ends: Any, accepted: np.ndarray) -> Any:
    """θ − the mean end parameters of the accepted workers, on the server."""

  def fresh_moments(self, state: Any) -> Any:
    """``state`` with a fresh inner optimizer state (its step count kept)."""

  def fetch(self, tree: Any, what: str) -> Any:
    """Worker states (``what="state"``), a pending Δ (``"delta"``) or a training loss
    (``"train_loss"``) as values."""

  def to_server(self, tree: Any) -> Any: ...
  def to_rounds(self, tree: Any) -> Any: ...
  def to_host(self, x: Any) -> np.ndarray: ...
  def agree(self, value: float) -> float:
    """``value`` as every process sees it (process 0's)."""

  def kill_worker(self, worker: int) -> None:
    """Kills worker ``worker`` (fault tests; Ray only)."""

  def describe(self) -> str:
    """Where the workers run, in words (the CLI's start line)."""

  def close(self) -> None:
    """Releases the runtime's resources."""


class OneProcess:
  """The transfers of a runtime whose arrays all live in the engine's one process.

  θ needs no placing for the server or for a round, values are read as they
  are, and every process agrees with itself. ``DeviceRuntime`` overrides
  these for device meshes and ``jax.distributed``.
  """

  def to_server(self, tree: Any) -> Any:
    return tree

  def to_rounds(self, tree: Any) -> Any:
    return tree

  def to_host(self, x: Any) -> np.ndarray:
    return np.asarray(x)

  def agree(self, value: float) -> float:
    return value


class Clock(Protocol):
  """Time as the engine sees it; ``SimulatedClock`` and ``RealClock`` implement it."""

  eager: bool  # start a dispatch's work at once (real hardware) or when it is needed

  def start(self, elapsed: float) -> None: ...
  def finish(self, worker: int, steps: int, now: float) -> float: ...
  def round_seconds(self, real_steps: np.ndarray, start: float) -> float: ...
  def plan_ddp(self, chunk: int, start: float, limit: float) -> tuple[int, Optional[list]]: ...
  def ddp_seconds(self, planned: Optional[list], start: float, params: Any) -> float: ...
  def get_state(self) -> Any: ...
  def set_state(self, state: Any) -> None: ...


class SimulatedClock:
  """Deterministic simulated seconds (docs/ALGORITHMS.md, "Time and cost model").

  A dispatch takes message + compute + message; a round its slowest worker
  plus one ring all-reduce; a DDP step the slowest worker's step plus one
  all-reduce, less what ``comm.ddp_overlap`` hides. Work is computed lazily (``eager`` False).
  """

  eager = False

  def __init__(self, seconds_per_step: np.ndarray, jitter: float, seed: int,
               comm: clock_lib.CommModel, model_bytes: int):
    self.steps = clock_lib.StepClock(seconds_per_step, jitter, seed)
    self.num_workers = len(seconds_per_step)
    self.message = comm.message_seconds(model_bytes)
    self.allreduce = comm.allreduce_seconds(model_bytes, self.num_workers)
    self.comm = comm

  def start(self, elapsed: float) -> None:
    del elapsed

  def finish(self, worker: int, steps: int, now: float) -> float:
    return now + self.message + self.steps.duration(worker, steps) + self.message

  def round_seconds(self, real_steps: np.ndarray, start: float) -> float:
    del start
    return (max(self.steps.duration(i, int(real_steps[i])) for i in range(self.num_workers))
            + self.allreduce)

  def plan_ddp(self, chunk: int, start: float, limit: float) -> tuple[int, Optional[list]]:
    """(steps to run, their seconds): only the steps that end within ``limit`` (0 = none)."""
    seconds = [self.comm.ddp_step_seconds(
        max(self.steps.duration(i, 1) for i in range(self.num_workers)), self.allreduce)
               for _ in range(chunk)]
    if limit > 0:
      chunk = int(np.sum(start + np.cumsum(seconds) <= limit))
      seconds = seconds[:chunk]
    return chunk, seconds

  def ddp_seconds(self, planned: Optional[list], start: float, params: Any) -> float:
    del start, params
    return sum(planned)

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

  def __init__(self, agree: Callable[[float], float]):
    self._agree = agree
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

  def plan_ddp(self, chunk: int, start: float, limit: float) -> tuple[int, Optional[list]]:
    del start
    return (0 if limit > 0 and self.now() >= limit else chunk), None

  def ddp_seconds(self, planned: Optional[list], start: float, params: Any) -> float:
    del planned
    jax.block_until_ready(params)
    return self.now() - start

  def get_state(self) -> Any:
    return None

  def set_state(self, state: Any) -> None:
    del state
