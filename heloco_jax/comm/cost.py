"""The communication cost model of the simulated clock (docs/ALGORITHMS.md, "Time and cost
model"): a model-sized message costs latency + bytes/bandwidth; a ring all-reduce of B bytes over
K workers costs latency + 2·(K−1)/K·B/bandwidth; free by default.
"""

from __future__ import annotations

import dataclasses
import math


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
