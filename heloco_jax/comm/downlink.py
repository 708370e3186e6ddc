"""How θ reaches a worker when downloads are compressed (docs/ALGORITHMS.md, "Compressed
downloads").

The server keeps, per worker, x̂_i: the start point the worker last built. A first
dispatch sends the dispatch point θ_d whole (x̂_i ← θ_d); a later one sends the message
m = C(θ_d − x̂_i), from which the worker starts at x̂_i + D(m), and x̂_i takes that value.
What a message drops stays in θ_d − x̂_i and goes with the next one (error feedback
without a residual of its own). With fragments, x̂ of fragment p is the worker's anchor of p
(``runtime.streaming.dispatch_fragment``), and ``DownlinkState`` is not used.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax

from heloco_jax.comm import compress as compress_lib
from heloco_jax.comm import fragments as fragments_lib


def message(compressor: compress_lib.Compressor, point: Any, held: Any) -> Any:
  """The server's side: m = C(θ_d − x̂), the payload of dispatch point ``point`` (θ_d) for
  a worker holding ``held`` (x̂). Pure: ``jax.jit`` takes it."""
  difference = jax.tree.map(lambda p, h: p - h, point, held)
  payload, _ = compressor.compress(difference, compressor.init(difference))
  return payload


def apply(compressor: compress_lib.Compressor, held: Any, payload: Any) -> Any:
  """The worker's side: x̂ + D(m) in θ's dtypes, the start it builds from message
  ``payload``. Pure: ``jax.jit`` takes it."""
  received = compressor.decompress(payload)
  return jax.tree.map(lambda h, r: h + r.astype(h.dtype), held, received)


class Downlink:
  """Compressed downloads of θ (module docstring).

  Args:
    compressor: a ``heloco_jax.comm.compress.Compressor`` (one with error feedback
      works as without: its residual starts at 0 at every message).
    params: θ (shapes and dtypes: the bytes of a message).
    fragments: θ's split (``heloco_jax.comm.fragments.Fragments``, as ``Uplink``'s; with
      several, a worker's x̂ of fragment p is its anchor of p, ``runtime.streaming``); None:
      θ whole.

  Attributes:
    message_bytes: a later dispatch's message on the wire.
    model_bytes: θ's bytes (a worker's first dispatch).
    fragment_bytes: per fragment, its message on the wire.
  """

  def __init__(self, compressor: compress_lib.Compressor, params: Any,
               fragments: Optional[fragments_lib.Fragments] = None):
    self.compressor = compressor
    self.fragments = fragments
    self.message_bytes = compress_lib.payload_nbytes(compressor, params)
    self.model_bytes = compress_lib.payload_nbytes(None, params)
    self.fragment_bytes = ([self.message_bytes] if fragments is None or fragments.num == 1 else
                           [compress_lib.payload_nbytes(compressor, fragments.take(params, p))
                            for p in range(fragments.num)])
    # Two programs, as where server and worker are apart (runtime="ray"): the same bits.
    self.message = jax.jit(functools.partial(message, compressor))
    self.apply = jax.jit(functools.partial(apply, compressor))

  def start(self, worker: int, point_of: Callable[[], Any], held: Any) -> Any:
    """The start of ``worker``'s dispatch: the dispatch point (``point_of()``) whole when it
    holds nothing (``held`` None), else x̂ + D(C(θ_d − x̂)) with x̂ = ``held``."""
    del worker  # one x̂ per worker, kept by ``DownlinkState``
    point = point_of()
    return point if held is None else self.apply(held, self.message(point, held))

  # With fragments (``runtime.streaming.dispatch_fragment``): a worker's x̂ of fragment p is
  # its anchor of p, so its anchors (θ as it last received each fragment) are its x̂.

  def whole(self, worker: int, server: Any) -> Any:
    """``worker``'s anchors when it receives θ as a whole (``server``: the run's
    ``FragmentServers``): the dispatch point, sent whole."""
    del worker
    return server.dispatch_point()

  def fragment(self, worker: int, server: Any, anchors: Any, p: int) -> tuple[Any, Any]:
    """``worker``'s anchors after it receives fragment ``p`` compressed, and that fragment:
    x̂ + D(C(θ_p − x̂)) with x̂ its anchor of p."""
    del worker
    fragments = self._split()
    payload = self.message(server.fragment_point(p), fragments.take(anchors, p))
    return self.received(fragments, anchors, p, payload)

  def received(self, fragments: fragments_lib.Fragments, anchors: Any, p: int,
               payload: Any) -> tuple[Any, Any]:
    """The worker's side of ``fragment``: its anchors with fragment ``p`` at its anchor +
    D(``payload``), and that fragment (where server and worker are apart, runtime="ray")."""
    held = fragments.take(anchors, p)
    arrived = self.apply(held, payload)
    return fragments.put(anchors, arrived, p), arrived

  def anchor(self, anchors: Any, p: int) -> Any:
    """Fragment ``p`` of ``anchors`` (where the worker's Δ of p starts)."""
    return self._split().take(anchors, p)

  def _split(self) -> fragments_lib.Fragments:
    if self.fragments is None:
      raise ValueError("Downlink: fragment downloads need θ's split (fragments=...)")
    return self.fragments


@dataclasses.dataclass
class DownlinkState:
  """Per worker, x̂_i (the checkpoint's "downlink" arrays) and the bytes of its latest
  download (0: it holds nothing of θ yet, and its next dispatch sends θ whole)."""
  held: Any = dataclasses.field(default=None, metadata={"array": "downlink"})
  bytes_down: list = dataclasses.field(default_factory=list)

  def start(self, params: Any, num_workers: int) -> None:
    """Before the first dispatches: no worker holds θ yet (``held``: placeholders)."""
    self.held, self.bytes_down = [params] * num_workers, [0] * num_workers

  def send(self, downlink: Downlink, worker: int, point_of: Callable[[], Any]) -> Any:
    """The start of ``worker``'s dispatch from the dispatch point ``point_of()``: θ whole at
    its first dispatch (or after it came back), else ``downlink``'s message; the worker's x̂
    becomes that start."""
    whole = self.bytes_down[worker] == 0
    self.held[worker] = downlink.start(worker, point_of, None if whole else self.held[worker])
    self.bytes_down[worker] = downlink.model_bytes if whole else downlink.message_bytes
    return self.held[worker]

  def forget(self, worker: int) -> None:
    """``worker`` left: it holds nothing of θ when it comes back."""
    self.bytes_down[worker] = 0
