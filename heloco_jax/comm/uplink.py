"""How a worker's Δ reaches the server: compressed or not, fragment by fragment, and the bytes
each way (docs/ALGORITHMS.md, "Compression in a run" and "Fragments")."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from heloco_jax.comm import compress as compress_lib
from heloco_jax.comm import fragments as fragments_lib


@dataclasses.dataclass
class CompressionState:
  """The workers' compressor states (error feedback's residuals), per fragment: what
  ``Uplink.init`` returns; saved as the checkpoint's "compression" arrays. None without a
  compressor."""
  states: Any = dataclasses.field(default=None, metadata={"array": "compression"})


class Uplink:
  """How a worker's Δ reaches the server: compressed or not, fragment by fragment, and the
  bytes each way (ALGORITHMS.md, "Compression in a run" and "Fragments").

  Args:
    compressor: a ``heloco_jax.comm.compress.Compressor``, or None: Δ is sent as it is.
    params: θ (shapes and dtypes: the bytes of a message).
    fragments: θ's split (``heloco_jax.comm.fragments.Fragments``).

  Attributes:
    bytes_up: per fragment, one worker's Δ of it on the wire (the compressor's payload).
    bytes_down: per fragment, its θ sent to a worker (its own bytes).
    model_bytes: θ's bytes (a first dispatch sends all of θ).
  """

  def __init__(self, compressor: Optional[compress_lib.Compressor], params: Any,
               fragments: fragments_lib.Fragments):
    self.compressor = compressor
    self.fragments = fragments
    parts = [fragments.take(params, p) for p in range(fragments.num)]
    self.bytes_up = [compress_lib.payload_nbytes(compressor, part) for part in parts]
    self.bytes_down = [compress_lib.payload_nbytes(None, part) for part in parts]
    self.model_bytes = compress_lib.payload_nbytes(None, params)
    if compressor is not None:
      self._transmit = jax.jit(functools.partial(compress_lib.transmit, compressor))
      self._send = jax.jit(functools.partial(compress_lib.send, compressor))
      self._receive = [jax.jit(functools.partial(compress_lib.receive, compressor,
                                                 like=jax.eval_shape(lambda x: x, part)))
                       for part in parts]
      self._init = jax.jit(compressor.init)
      self._round = jax.jit(functools.partial(_compressed_round_delta, compressor))

  def init(self, params: Any, num_workers: int, stacked: bool) -> Any:
    """The K workers' first compressor states, per fragment (None without a compressor):
    ``[worker][fragment]``, or for rounds ``[fragment]`` stacked over workers on axis 0; host
    arrays."""
    if self.compressor is None:
      return None
    # On the host: the first compression places them where the worker's Δ is.
    states = [jax.device_get(self._init(self.fragments.take(params, p)))
              for p in range(self.fragments.num)]
    if stacked:
      return [jax.tree.map(lambda x: np.stack([x] * num_workers), state) for state in states]
    return [list(states) for _ in range(num_workers)]  # never changed in place

  def transmit(self, delta: Any, state: Any) -> tuple[Any, Any]:
    """(what the server receives of Δ, the worker's next state): ``compress.transmit``, in
    one program where Δ is (the simulated runtime). Only with a compressor: without one
    the executor hands Δ on as it is (``Executor.transmit``)."""
    assert self.compressor is not None
    return self._transmit(delta, state)

  def send(self, delta: Any, state: Any) -> tuple[compress_lib.Message, Any]:
    """The worker's half, where Δ and ``state`` are: (its message, its next state)."""
    assert self.compressor is not None
    return self._send(delta, state)

  def receive(self, message: compress_lib.Message, fragment: int) -> Any:
    """The server's half, where ``message`` is: fragment ``fragment``'s Δ as received."""
    return self._receive[fragment](message)

  def round_delta(self, params: Any, ends: Any, accepted: np.ndarray,
                  states: Any) -> tuple[Any, Any]:
    """A round in which every worker sends its compressed Δ_i = θ − end_i: (the mean of the
    accepted workers' received Δ_i, the workers' next states, stacked on axis 0)."""
    return self._round(params, ends, accepted, states)


def _compressed_round_delta(compressor: compress_lib.Compressor, params: Any, ends: Any,
                            accepted: jax.Array, states: Any) -> tuple[Any, Any]:
  """``Uplink.round_delta`` (ALGORITHMS.md, "Compression in a run"); a rejected worker keeps
  its state (``compress.transmit``)."""
  k = len(accepted)
  sent = [compress_lib.transmit(compressor,
                                jax.tree.map(lambda theta, end: theta - end[i], params, ends),
                                jax.tree.map(lambda x: x[i], states)) for i in range(k)]
  # Worker by worker, not jax.vmap: batched, XLA rounds the quantizers' scaling differently
  # (a few ulps off the unbatched compressor and the NumPy reference).
  received, states = jax.tree.map(lambda *xs: jnp.stack(xs), *sent)
  weights = accepted.astype(jnp.float32) / jnp.sum(accepted)
  def mean(r):  # a rejected worker's Δ may hold NaN: 0·NaN is NaN, so it is dropped first
    kept = jnp.where(accepted.reshape((-1,) + (1,) * (r.ndim - 1)), r, 0)
    return jnp.tensordot(weights.astype(r.dtype), kept, axes=1)
  return jax.tree.map(mean, received), states
