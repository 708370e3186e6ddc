"""The workers' speeds, DyLU and real time (ALGORITHMS.md, "Time and cost model" and "DyLU").

* Worker i's inner step takes t_i seconds (``seconds_per_step``), from a named
  heterogeneity preset of the HeLoCo authors' code or an explicit list. The
  simulated runtime's clock times its steps with them
  (``heloco_jax.runtime.simulated.SimulatedClock``); the communication costs are
  ``heloco_jax.comm.cost.CommModel``'s.
* DyLU gives worker i H_i = max(1, ⌊(v_i/v_ref)·H⌋) inner steps, v_i = 1/t_i
  its speed and v_ref the fastest worker's, on every runtime.
* ``RealClock``: the devices and Ray runtimes' time, seconds since the run began.
"""

from __future__ import annotations

import asyncio
import math
import numbers
import time
from typing import Any, Optional, Sequence, Union

import jax
import numpy as np

from heloco_jax.runtime import base
from heloco_jax.runtime.base import ClockSettings, Executor

# Seconds per inner step for 5 workers (the HeLoCo authors' presets).
PRESETS: dict[str, tuple[float, ...]] = {
    "homogeneous": (1.0, 1.0, 1.0, 1.0, 1.0),
    "mild": (1.0, 1.0, 1.0, 2.0, 2.0),
    "moderate": (1.0, 6.0, 6.0, 6.0, 6.0),
    "severe": (1.0, 15.0, 15.0, 15.0, 15.0),
    "mixed": (1.0, 2.0, 3.0, 1.0, 5.0),
}

Speeds = Union[str, Sequence[float]]


def seconds_per_step(speeds: Speeds, num_workers: int) -> np.ndarray:
  """t_i for each of ``num_workers`` workers, float64.

  Args:
    speeds: a preset name (``PRESETS``; with K ≠ 5 workers worker i gets
      entry i mod 5, so K = 16 or 64 keeps the preset's mix of speeds) or a
      list of K positive seconds per step.
    num_workers: K.

  Raises:
    ValueError: naming ``speeds`` and what is allowed.
  """
  if isinstance(num_workers, bool) or not isinstance(num_workers, numbers.Integral) \
      or num_workers < 1:
    raise ValueError(f"num_workers={num_workers!r} is not allowed; allowed: an integer >= 1.")
  if isinstance(speeds, str):
    if speeds not in PRESETS:
      raise ValueError(f"speeds={speeds!r} is not allowed; allowed: one of "
                       f"{', '.join(PRESETS)}, or a list of {num_workers} seconds per step.")
    preset = PRESETS[speeds]
    return np.array([preset[i % len(preset)] for i in range(num_workers)], np.float64)
  try:
    values = np.asarray(speeds, np.float64)
  except (TypeError, ValueError):
    values = None
  if (values is None or values.shape != (num_workers,) or not np.all(np.isfinite(values))
      or not np.all(values > 0)):
    raise ValueError(f"speeds={speeds!r} is not allowed; allowed: a preset name "
                     f"({', '.join(PRESETS)}) or a list of {num_workers} positive seconds "
                     "per step (one per worker).")
  return values


def dylu_steps(seconds: np.ndarray, inner_steps: int) -> np.ndarray:
  """DyLU: H_i = max(1, ⌊(v_i / v_ref)·H⌋) with v_i = 1/t_i, v_ref = max_i v_i.

  Args:
    seconds: t_i per worker.
    inner_steps: H, the fastest worker's number of inner steps.

  Returns:
    int64 H_i per worker.
  """
  speed = 1.0 / np.asarray(seconds, np.float64)
  # The 1e-9 keeps ⌊·⌋ exact where the ratio·H is an integer that floating point lands a
  # hair below (t = [0.2, 2.6], H = 39 gives 2.9999999999999996 for 3).
  return np.maximum(1, np.floor(speed / speed.max() * inner_steps + 1e-9)).astype(np.int64)


class RealClock:
  """Seconds of real time the run has trained, all resumed parts together.

  Across processes (``jax.distributed``) process 0's clock, so that every
  process takes the same budget decisions. Work starts at dispatch.

  The run's link (``comm``, ``cost.Link``) is waited in real time: a dispatch's arrival
  comes its download and upload seconds after its work is done (``transit``), a round
  and a DDP step wait their all-reduce (docs/DESIGN.md, "Runtimes"). The default link is
  free: nothing waits.
  """

  eager = True
  simulated = False

  def __init__(self, settings: ClockSettings, executor: Executor):
    self._agree = executor.agree
    self._start = time.perf_counter()
    self._ddp_step = math.inf  # the fastest DDP step timed (plan_ddp → ddp_seconds)
    self._ddp_timing: Optional[tuple[float, int]] = None  # (when, steps) planned last
    self.link = link = base.link_of(settings)
    self.comm, self.download, self.upload = link.comm, link.download, link.upload
    self._transit: dict[int, float] = {}  # per worker, its dispatch's link seconds
    self._ddp_exposed = 0.0  # each DDP step's all-reduce wait, last chunk

  def transit(self, worker: int) -> float:
    """The link seconds of ``worker``'s latest dispatch (its arrival waits them)."""
    return self._transit.pop(worker, 0.0)

  def _wait(self, seconds: float) -> None:
    if seconds > 0:  # a synchronous step: nothing else runs meanwhile
      time.sleep(seconds)

  def start(self, elapsed: float) -> None:
    self._start = time.perf_counter() - elapsed

  def now(self) -> float:
    return self._agree(time.perf_counter() - self._start)

  def finish(self, worker: int, steps: int, now: float,
             download_bytes: Optional[int] = None) -> float:
    del steps
    if not self.link.free:
      self._transit[worker] = self.link.dispatch_seconds(download_bytes)
    return now  # the arrivals queue reads the time when the devices finish

  def round_seconds(self, real_steps: np.ndarray, start: float) -> float:
    del real_steps
    self._wait(self.link.allreduce)
    return self.now() - start

  def fragment_arrival(self, worker: int, steps: int, now: float, received: Optional[int],
                       sent: int) -> float:
    del steps
    if not self.link.free:
      self._transit[worker] = self.fragment_wait(worker, received, sent)
    return now  # the arrivals queue reads the time when the devices finish

  def fragment_wait(self, worker: int, received: Optional[int], sent: int) -> float:
    """A fragment sync's link seconds: θ's or the fragment's download and the upload of what
    it sends (the real clock overlaps no steps with them)."""
    del worker
    down = self.link.download if received is None else self.link.downloads[received]
    return down + self.link.uploads[sent]

  def exposed_allreduce(self, fragment: int) -> float:
    return self.link.allreduces[fragment]

  def fragment_round_seconds(self, steps: int, fragment: int, start: float,
                             present: Optional[np.ndarray] = None) -> float:
    del steps, present
    self._wait(self.link.allreduces[fragment])
    return self.now() - start

  def plan_ddp(self, chunk: int, start: float, limit: float,
               workers: Optional[np.ndarray] = None) -> tuple[int, Optional[list]]:
    """With a failure schedule (``workers`` given), steps of the fastest DDP step timed so
    far, the first also holding the seconds since ``start`` (FAILURES.md): the loop cuts the
    chunk at the next event by them. None before a step has been timed, or with no
    schedule; exposed all-reduce seconds are unknown (None)."""
    if workers is None:  # no schedule: nothing to cut (and no clock read without a limit)
      if not self.link.free:  # the chunk's compute, timed for its all-reduces (ddp_seconds)
        self._ddp_timing = self.now(), chunk
      return (0 if limit > 0 and self.now() >= limit else chunk), None
    now = self.now()
    if limit > 0 and now >= limit:
      return 0, None
    self._ddp_timing = now, chunk
    if not math.isfinite(self._ddp_step):
      return chunk, None
    return chunk, [(now - start + self._ddp_step, None)] + [(self._ddp_step, None)] * (chunk - 1)

  def ddp_seconds(self, planned: Optional[list], start: float, params: Any) -> float:
    jax.block_until_ready(params)
    now = self.now()
    if self._ddp_timing is None or params is None:
      return now - start
    began, steps = self._ddp_timing  # the steps as cut (planned) ran
    steps = max(1, steps if planned is None else len(planned))
    if not self.link.free:  # each step's all-reduce, less what its compute hides
      compute = (now - began) / steps
      self._ddp_exposed = self.comm.ddp_step_seconds(
          compute, self.link.ddp_allreduce(self.link.num_workers)) - compute
      self._wait(steps * self._ddp_exposed)
      now = self.now()
    self._ddp_step = min(self._ddp_step, (now - began) / steps)  # compiles only slow it
    self._ddp_timing = None
    return now - start

  def ddp_exposed(self, planned: Optional[list], step: int) -> Optional[float]:
    """The all-reduce seconds each DDP step of the last chunk waited (None with a free
    link: the real clock's network time is the link's)."""
    del planned, step
    return None if self.link.free else self._ddp_exposed

  async def wait_until(self, t: float) -> None:
    await asyncio.sleep(max(0.0, t - self.now()))

  def get_state(self) -> Any:
    return None

  def set_state(self, state: Any) -> None:
    del state
