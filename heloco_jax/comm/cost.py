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


@dataclasses.dataclass(frozen=True)
class Link:
  """A run's link (docs/ALGORITHMS.md, "Time and cost model"), which both clocks charge: the
  simulated clock adds its seconds to simulated time, the real clock waits them in real time
  (docs/DESIGN.md, "Runtimes": a slow link emulated on fast hardware).

  Attributes:
    comm: the cost model.
    num_workers: K (an all-reduce's ring).
    model_bytes: θ's bytes (a whole download, a DDP step's gradient).
    upload_bytes, download_bytes: per fragment, a worker's Δ on the wire and the fragment's
      θ (one entry: θ as one fragment).
  """
  comm: CommModel
  num_workers: int
  model_bytes: int
  upload_bytes: tuple[int, ...]
  download_bytes: tuple[int, ...]

  @classmethod
  def of(cls, comm: CommModel, num_workers: int, model_bytes: int,
         upload_bytes=None, download_bytes=None) -> "Link":
    return cls(comm, num_workers, model_bytes, tuple(upload_bytes or [model_bytes]),
               tuple(download_bytes or [model_bytes]))

  @property
  def free(self) -> bool:
    """Every transfer takes no time (the default model): a real clock waits nothing."""
    return self.comm.latency == 0 and math.isinf(self.comm.bandwidth)

  @property
  def download(self) -> float:
    """A dispatch's download of θ whole."""
    return self.comm.message_seconds(self.model_bytes)

  @property
  def uploads(self) -> list[float]:
    return [self.comm.message_seconds(b) for b in self.upload_bytes]

  @property
  def downloads(self) -> list[float]:
    return [self.comm.message_seconds(b) for b in self.download_bytes]

  @property
  def allreduces(self) -> list[float]:
    return [self.comm.allreduce_seconds(b, self.num_workers) for b in self.upload_bytes]

  @property
  def upload(self) -> float:
    return self.uploads[0]

  @property
  def allreduce(self) -> float:
    return self.allreduces[0]

  def dispatch_seconds(self, download_bytes=None, sent: int = 0) -> float:
    """A dispatch's transfers: θ's download (or one of ``download_bytes``) and the upload of
    fragment ``sent``'s Δ."""
    down = (self.download if download_bytes is None
            else self.comm.message_seconds(download_bytes))
    return down + self.uploads[sent]

  def ddp_allreduce(self, workers: int) -> float:
    return self.comm.allreduce_seconds(self.model_bytes, workers)
