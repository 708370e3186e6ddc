"""Simulated time: worker speeds, communication costs and DyLU (ALGORITHMS.md,
"Time and cost model" and "DyLU").

Everything here is pure and deterministic given its seed, so the simulated
runtime reproduces bit for bit:

* Worker i's inner step takes t_i seconds (``seconds_per_step``), from a named
  heterogeneity preset of the HeLoCo authors' code or an explicit list;
  optional multiplicative per-step jitter.
* A model-sized message costs latency + bytes/bandwidth; a ring all-reduce of
  B bytes over K workers costs latency + 2·(K−1)/K·B/bandwidth; free by
  default.
* DyLU gives worker i H_i = max(1, ⌊(v_i/v_ref)·H⌋) inner steps, v_i = 1/t_i
  its speed and v_ref the fastest worker's.
"""

from __future__ import annotations

import numbers
import time
from typing import Any, Optional, Sequence, Union

import jax
import numpy as np

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


class StepClock:
  """Simulated compute time of inner steps, with optional per-step jitter.

  Each step of worker i takes t_i·(1 + jitter·u), u ~ Uniform(−1, 1) drawn
  from worker i's own generator (seeded by ``seed`` and i), so a worker's
  durations do not depend on how the other workers are scheduled.

  Args:
    seconds: t_i per worker (``seconds_per_step``).
    jitter: relative per-step jitter in [0, 1); 0 (default) is exact.
    seed: seeds the jitter.
  """

  def __init__(self, seconds: np.ndarray, jitter: float = 0.0, seed: int = 0):
    if not 0 <= jitter < 1:
      raise ValueError(f"jitter={jitter!r} is not allowed; allowed: a number in [0, 1).")
    self.seconds = np.asarray(seconds, np.float64)
    self.jitter = float(jitter)
    self._rngs = [np.random.default_rng([seed, i]) for i in range(len(self.seconds))]

  def duration(self, worker: int, steps: int) -> float:
    """Simulated seconds for ``steps`` inner steps of ``worker``."""
    if self.jitter == 0.0:
      return float(steps * self.seconds[worker])
    noise = self._rngs[worker].uniform(-1.0, 1.0, size=steps)
    return float(np.sum(self.seconds[worker] * (1.0 + self.jitter * noise)))

  def get_state(self) -> list[dict]:
    """The jitter generators' states (for checkpoints)."""
    return [rng.bit_generator.state for rng in self._rngs]

  def set_state(self, state: list[dict]) -> None:
    for rng, s in zip(self._rngs, state, strict=True):
      rng.bit_generator.state = s


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
    self.steps = StepClock(settings.seconds_per_step, settings.jitter, settings.seed)
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

  def finish(self, worker: int, steps: int, now: float,
             download_bytes: Optional[int] = None) -> float:
    """When a dispatch's Δ reaches the server: θ's download (or one of ``download_bytes``),
    its steps and its upload."""
    down = self.download if download_bytes is None else self.comm.message_seconds(download_bytes)
    return now + down + self.steps.duration(worker, steps) + self.upload

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

  def fragment_round_seconds(self, steps: int, fragment: int, start: float,
                             present: Optional[np.ndarray] = None) -> float:
    """A round of ``steps`` steps of the ``present`` workers (default all) that ends in
    fragment ``fragment``'s exposed all-reduce."""
    del start  # the round's seconds are simulated
    compute = max(self.steps.duration(i, steps if present is None or present[i] else 0)
                  for i in range(self.num_workers))
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

  def finish(self, worker: int, steps: int, now: float,
             download_bytes: Optional[int] = None) -> float:
    del worker, steps, download_bytes
    return now  # the arrivals queue reads the time when the devices finish

  def round_seconds(self, real_steps: np.ndarray, start: float) -> float:
    del real_steps
    return self.now() - start

  def fragment_arrival(self, worker: int, steps: int, now: float, received: Optional[int],
                       sent: int) -> float:
    del worker, steps, received, sent
    return now  # the arrivals queue reads the time when the devices finish

  def fragment_round_seconds(self, steps: int, fragment: int, start: float,
                             present: Optional[np.ndarray] = None) -> float:
    del steps, fragment, present
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
