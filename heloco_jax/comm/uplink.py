"""How a worker's Δ reaches the server: compressed or not, fragment by fragment, and the bytes
each way (docs/ALGORITHMS.md, "Compression in a run" and "Fragments")."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from heloco_jax.training import aggregate as aggregate_lib
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
    aggregate: how a round's received Δ_i combine (``hj.aggregate``; default the mean).

  Attributes:
    bytes_up: per fragment, one worker's Δ of it on the wire (the compressor's payload).
    bytes_down: per fragment, its θ sent to a worker (its own bytes).
    model_bytes: θ's bytes (a first dispatch sends all of θ).
  """

  def __init__(self, compressor: Optional[compress_lib.Compressor], params: Any,
               fragments: fragments_lib.Fragments,
               aggregate: aggregate_lib.Aggregate = aggregate_lib.Mean()):
    self.compressor = compressor
    self.aggregate = aggregate
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
      self._round = jax.jit(functools.partial(_compressed_round_delta, compressor, aggregate))
      self._exchanges: dict[jax.sharding.Mesh, Callable[..., Any]] = {}

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

  def round_delta(self, params: Any, ends: Any, accepted: np.ndarray, states: Any,
                  mesh: Optional[jax.sharding.Mesh] = None) -> tuple[Any, Any]:
    """A round in which every worker sends its compressed Δ_i = θ − end_i: (the mean of the
    accepted workers' received Δ_i, the workers' next states, stacked on axis 0).

    ``mesh``: None, one program where the K ends are (the simulated runtime); or a mesh
    whose ``workers`` axis holds the K workers one each (``runtime="devices"``, across
    processes too), where each worker sends on its own devices and only the messages cross,
    gathered over ``workers`` (ALGORITHMS.md, "Compression in a run"). The same bits.
    """
    if mesh is None:
      return self._round(params, ends, accepted, states)
    if mesh.shape["workers"] != len(accepted):
      raise ValueError(f"Uplink.round_delta: a mesh of {mesh.shape['workers']} workers for "
                       f"{len(accepted)} workers' ends; allowed: one worker per slice of "
                       "``workers``")
    if mesh not in self._exchanges:
      self._exchanges[mesh] = _exchange(self.compressor, self.aggregate, mesh)
    return self._exchanges[mesh](params, ends, accepted, states)


def _compressed_round_delta(compressor: compress_lib.Compressor,
                            aggregate: aggregate_lib.Aggregate, params: Any, ends: Any,
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
  return _combined(aggregate, received, accepted), states


def _combined(aggregate: aggregate_lib.Aggregate, received: Any, accepted: jax.Array) -> Any:
  """The accepted workers' received Δ_i (stacked on axis 0) as one: their mean
  (``aggregate.accepted_mean``, today's bits) or a peer rule's (ALGORITHMS.md, "Aggregation")."""
  if isinstance(aggregate, aggregate_lib.Mean):
    return aggregate_lib.accepted_mean(received, accepted)
  return aggregate_lib.combine(aggregate, received,
                               accepted.astype(jnp.float32) / jnp.sum(accepted))


def _gather_bits(x: jax.Array) -> jax.Array:
  """``x`` of every worker (stacked on axis 0), moved as its bits: a float payload crosses in
  its own width (XLA would otherwise widen bf16 to float32 before the gather)."""
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return jax.lax.all_gather(x, "workers")
  bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
  return jax.lax.bitcast_convert_type(jax.lax.all_gather(bits, "workers"), x.dtype)


def _exchange(compressor: compress_lib.Compressor, aggregate: aggregate_lib.Aggregate,
              mesh: jax.sharding.Mesh) -> Callable[..., Any]:
  """``Uplink.round_delta`` on ``mesh``: each worker (a slice of the ``workers`` axis)
  sends its Δ_i where its end is; the messages are all-gathered over ``workers`` (what
  crosses: the payloads and their flags) and every worker receives them all; the other
  axes (θ's, ``data``) stay with XLA."""
  spread = P("workers")

  def exchange(params, ends, accepted, states):
    take = functools.partial(jax.tree.map, lambda x: x[0])  # this worker's slice
    delta = jax.tree.map(lambda theta, end: theta - end, params, take(ends))
    message, state = compress_lib.send(compressor, delta, take(states))
    messages = jax.tree.map(_gather_bits, message)
    like = jax.eval_shape(lambda t: t, delta)
    received = [compress_lib.receive(compressor, jax.tree.map(lambda m, i=i: m[i], messages),
                                     like) for i in range(len(accepted))]
    received = jax.tree.map(lambda *xs: jnp.stack(xs), *received)
    return _combined(aggregate, received, accepted), jax.tree.map(lambda x: x[None], state)

  # check_vma=False: the mean is computed from the gathered messages alike on every worker
  # (replicated), which jax 0.10's all_gather does not mark.
  return jax.jit(jax.shard_map(exchange, mesh=mesh, in_specs=(P(), spread, P(), spread),
                               out_specs=(P(), spread), axis_names={"workers"},
                               check_vma=False))
