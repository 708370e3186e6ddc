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

import dataclasses
import math
import numbers
from typing import Sequence, Union

import numpy as np

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


@dataclasses.dataclass(frozen=True)
class CommModel:
  """Communication costs in simulated seconds; the default is free.

  Attributes:
    latency: seconds per message or collective, >= 0.
    bandwidth: bytes per second, > 0 (``math.inf``: transfers are instant).
    ddp_overlap: the fraction of a DDP step's compute that its all-reduce can
      hide behind, in [0, 1): a step takes t + max(0, A − ddp_overlap·t) for
      compute t and all-reduce A. 0 (the default) does not overlap; 2/3 is
      PyTorch DDP's bucketed all-reduce during the backward pass (about 2/3 of
      a step's compute). Only DDP steps overlap.
  """
  latency: float = 0.0
  bandwidth: float = math.inf
  ddp_overlap: float = 0.0

  def __post_init__(self):
    if not (math.isfinite(self.latency) and self.latency >= 0):
      raise ValueError(f"comm.latency={self.latency!r} is not allowed; allowed: a number >= 0.")
    if not self.bandwidth > 0:
      raise ValueError(f"comm.bandwidth={self.bandwidth!r} is not allowed; allowed: a number "
                       "> 0 (bytes per second; inf for free transfers).")
    if not 0 <= self.ddp_overlap < 1:
      raise ValueError(f"comm.ddp_overlap={self.ddp_overlap!r} is not allowed; allowed: a "
                       "number in [0, 1).")

  def message_seconds(self, num_bytes: float) -> float:
    """A point-to-point message of ``num_bytes``: latency + bytes/bandwidth."""
    return self.latency + num_bytes / self.bandwidth

  def allreduce_seconds(self, num_bytes: float, num_workers: int) -> float:
    """A ring all-reduce of ``num_bytes`` over K workers: latency + 2(K−1)/K·B/bandwidth.

    One worker needs no communication (0 seconds).
    """
    if num_workers <= 1:
      return 0.0
    return self.latency + 2.0 * (num_workers - 1) / num_workers * num_bytes / self.bandwidth

  def ddp_step_seconds(self, compute: float, allreduce: float) -> float:
    """A DDP step of ``compute`` seconds and an all-reduce of ``allreduce`` seconds, the part
    of the all-reduce that ``ddp_overlap`` hides behind the backward pass not counted."""
    return compute + max(0.0, allreduce - self.ddp_overlap * compute)


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
