"""``runtime="ray"``: a parameter server and workers as Ray actors, on one or many machines.

docs/DESIGN.md, "Runtimes". The engine (``heloco_jax.runtime.engine``) runs
the asynchronous methods here exactly as on the other runtimes; only where
things live changes:

  * the parameter-server actor (``OuterServer``, ``heloco_jax.training.server``) holds
    θ, the outer state and the jitted outer rule. The engine sends it each
    arrival group's pseudo-gradients as object refs (they go from the worker's
    node to the server's, not through the engine) and reads θ back only to
    evaluate and to checkpoint;
  * one worker actor per worker (or per ``workers_per_actor`` workers, each on its own
    ``devices_per_worker`` of the actor's devices: a TPU host's chips, a GPU node's GPUs)
    owns its accelerators (``gpus_per_worker``; with several devices a worker's batch is
    split over them, as on ``runtime=devices``) and builds the inner loop from the user's
    ``loss_fn`` and ``inner_tx`` (sent with cloudpickle): a dispatch sends the
    start point (an object ref of the server's dispatch point), the worker's
    previous inner state, its batches and a PRNG key;
  * compressed pseudo-gradients (``compress=``): the worker actor compresses its
    Δ with its compressor state (error feedback's residual) and returns the
    message (``compress.send``): the compressor's payload is what goes to the
    server actor, which decompresses it (``compress.receive``); the state stays
    an object ref on the worker's node until its next dispatch or a checkpoint;
  * fragments (``hj.Streaming``): one server actor per fragment; a worker actor
    runs a fragment dispatch whole (``streaming.FragmentSteps``: the arrived
    fragment's merge included); the engine keeps each worker's anchors, except
    with compressed downloads, where the worker actor keeps them (its x̂) and the
    fragment's server actor sends the message alone;
  * a model state (``loss_fn`` with ``state``/``rng``): a dispatch carries the
    server's copy and the worker actor steps it and the worker's keys; only the
    end state's model state comes back to the engine, which merges it;
  * the engine's asyncio loop awaits the actors' object refs and takes arrivals
    in the order they finish, on the real clock;
  * sharded θ (docs/DESIGN.md, "Scaling out"): every actor rebuilds θ's mesh
    on its own devices from ``Layout.recipe``, and arrays cross between
    processes as their distinct shards (``sharding.HostShards``); the driver
    keeps θ on the user's mesh.

Worker death (``kill -9``, a node lost, an out-of-memory kill): Ray restarts
the actor (up to ``RayOptions.max_restarts`` times) and runs its task again
with the same inputs, so the dispatch arrives as if nothing happened; an
``{"event": "actor_restarted"}`` row in ``metrics.jsonl`` counts each
restart (seen as a new process id). An actor out of restarts is given up:
its workers' dispatches are sent, with the same inputs, to a new actor
started in its place while ``RayOptions.replacements`` lasts (an
``{"event": "actor_added"}`` row: a scale-up back to K actors), else to the
live actor that runs the fewest workers (an ``{"event": "redispatched"}``
row). With
``RayOptions.spares`` standby actors, compiled on the first dispatch's inputs, a dead
actor is not restarted: a spare takes its workers at once (a ``{"event": "spare_took_over"}``
row). No
healthy actor is ever killed: an error is handled once, by the dispatch it
belongs to. θ lives on the server and is never touched by a worker's death;
the run stops with an error only when no worker actor is left.

Synchronous methods do not run here: across processes they run SPMD with
``jax.distributed`` (``runtime="devices"`` with the ``distributed.*`` keys).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import socket
import sys
import warnings
from typing import Any, Callable, Optional

import jax
import numpy as np

from heloco_jax.comm import compress
from heloco_jax.comm import downlink as downlink_lib
from heloco_jax.rundir import safe_files
from heloco_jax.runtime import clocks, simulated, streaming
from heloco_jax.runtime import devices as devices_lib
from heloco_jax.training import inner as inner_lib
from heloco_jax.training import server as server_lib
from heloco_jax.training import sharding

INSTALL_HINT = "pip install 'heloco-jax[ray]'"


def import_ray():
  """The ``ray`` module, or an ImportError saying how to install it."""
  try:
    import ray  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError(f"config.runtime='ray' needs Ray: {INSTALL_HINT}") from None
  return ray


class ServerActor(server_lib.OuterServer):
  """The parameter server as a Ray actor: what it returns goes to the host first (sharded
  arrays as ``sharding.HostShards``).

  Args:
    outer_tx: the outer rule.
    params: θ on the host (``HostShards`` when sharded).
    options: ``OuterServer``'s keywords.
    recipe: θ's ``Layout.recipe`` when θ is sharded: θ, the outer state and the
      outer step take θ's specs on a mesh of this actor's devices.
  """

  def __init__(self, outer_tx: Any, params: Any, options: dict[str, Any],
               recipe: Optional[tuple] = None):
    self._receiving: tuple[Optional[bytes], Any] = (None, None)  # (pickled, jitted receive)
    self._held: dict[int, Any] = {}  # per worker, x̂ of compressed downloads
    self._downlinks = _Downlinks()
    if recipe is None:
      super().__init__(outer_tx, params, place=jax.device_put, **options)
      return
    layout = sharding.layout_on(*recipe, jax.devices())
    super().__init__(outer_tx, layout.from_host(params), place=layout.from_host,
                     layout=layout, **options)

  def dispatch_point(self) -> Any:
    return sharding.to_host(super().dispatch_point())

  def node(self) -> str:
    """The id of the Ray node this actor runs on."""
    return import_ray().get_runtime_context().get_node_id()

  def get_params(self) -> Any:
    return sharding.to_host(self.params)

  def get(self) -> tuple[Any, Any]:
    return sharding.to_host(super().get())

  def download(self, worker: int, pickled: Optional[bytes]) -> Any:
    """Worker ``worker``'s download (docs/ALGORITHMS.md, "Compressed downloads"): the dispatch
    point θ_d whole (``pickled`` None) or the message C(θ_d − x̂) of the pickled compressor;
    x̂ (this actor's copy; ``hold`` restores it from a checkpoint) takes the start the worker
    builds, which ``WorkerActor.run`` builds alike."""
    point = super().dispatch_point()
    if pickled is None:
      self._held[worker] = point
      return sharding.to_host(point)
    link = self._downlinks(pickled, self._like)
    payload = link.message(point, self._held[worker])
    self._held[worker] = link.apply(self._held[worker], payload)
    return jax.device_get(payload)

  def hold(self, worker: int, held: Any) -> None:
    """Worker ``worker``'s x̂ restored from a checkpoint (with fragments: its anchor of this
    actor's fragment), for its next ``download``."""
    self._held[worker] = self._place(held)

  def _receive(self, pickled: bytes) -> Callable[[compress.Message], Any]:
    if self._receiving[0] != pickled:
      like = self._like
      self._receiving = (pickled, jax.jit(functools.partial(
          compress.receive, _unpickled(pickled), like=like)))
    return self._receiving[1]

  def update(self, taus: list[int], *deltas: Any, fetch: bool = True,
             weights: Optional[list[float]] = None,
             compressors: Optional[list[Optional[bytes]]] = None) -> list[dict]:
    """``OuterServer.update``; a Δ whose ``compressors`` entry is a pickled compressor
    arrived as its ``compress.Message`` and is decompressed here first."""
    if compressors is not None:
      deltas = tuple(delta if pickled is None else self._receive(pickled)(delta)
                     for delta, pickled in zip(deltas, compressors))
    if self.layout is not None:  # the workers' shards, onto this actor's mesh
      deltas = tuple(self._place(delta) for delta in deltas)
    return super().update(taus, *deltas, fetch=fetch, weights=weights)


@functools.lru_cache(maxsize=8)
def _unpickled(pickled: bytes) -> compress.Compressor:
  """The compressor a dispatch carries (cloudpickle's bytes), unpickled once per actor."""
  from ray import cloudpickle  # pylint: disable=g-import-not-at-top
  return cloudpickle.loads(pickled)


class _Downlinks:
  """An actor's compiled downloads (``downlink.Downlink``): one per pickled compressor."""

  def __init__(self):
    self._link: tuple[Optional[bytes], Any] = (None, None)

  def __call__(self, pickled: bytes, like: Any) -> downlink_lib.Downlink:
    if self._link[0] != pickled:
      self._link = (pickled, downlink_lib.Downlink(_unpickled(pickled), like))
    return self._link[1]


class WorkerActor:
  """One Ray worker: the compiled inner loop of ``loss_fn`` and ``inner_tx`` on its devices.

  With θ's ``Layout.recipe`` (θ sharded), its devices form a mesh of θ's mesh's shape and
  axis names, and its states keep θ's specs there; it receives and returns them as
  ``sharding.HostShards``.
  """

  def __init__(self, loss_fn: Any, inner_tx: Any, reset_optimizer: bool,
               recipe: Optional[tuple] = None, devices_per_worker: int = 0,
               workers_per_actor: int = 1):
    inner = inner_lib.InnerLoop(loss_fn, inner_tx, reset_optimizer)
    devices = jax.devices()
    self._sending: tuple[Optional[bytes], Any] = (None, None)  # (pickled, jitted send)
    self._downlinks = _Downlinks()
    self._layout = None
    self._slots = workers_per_actor
    # A host's chips (docs/GUIDE.md, "Pods"): each of the actor's workers_per_actor workers on
    # its own devices_per_worker of them (0: an equal share of all), its batch split over them.
    per_worker = self.group_size = devices_per_worker or max(1, len(devices) // workers_per_actor)
    self.problem = None if per_worker * workers_per_actor <= len(devices) else (
        f"ray.devices_per_worker={devices_per_worker} × ray.workers_per_actor="
        f"{workers_per_actor} is not allowed on an actor with {len(devices)} device(s); allowed: "
        f"at most {len(devices)} devices per actor in all (0: an equal share)")
    if self.problem is not None:
      return
    if recipe is not None:
      self._layout = sharding.layout_on(*recipe, devices)
      self._inner = inner.with_layout(self._layout)
    elif per_worker > 1 or workers_per_actor > 1:  # data-parallel over each worker's devices
      groups = devices_lib.group_devices(workers_per_actor, per_worker,
                                         [per_worker] * workers_per_actor, devices=devices)
      self._executor = devices_lib.DeviceExecutor(inner, groups)
    else:
      self._executor = simulated.LocalExecutor(inner, devices[:1])

  def describe(self) -> tuple[list[str], Optional[str], int]:
    """(this actor's devices, why its settings do not fit them or None, devices per worker)."""
    return [f"{d.platform}:{d.id}" for d in jax.devices()], self.problem, self.group_size

  def pid(self) -> int:
    return os.getpid()

  def node(self) -> str:
    """The id of the Ray node this actor runs on."""
    return import_ray().get_runtime_context().get_node_id()

  def run(self, worker: int, start: Any, previous: Optional[inner_lib.InnerState],
          batches: Any, key_data: np.ndarray, fresh: bool, compressor: Optional[bytes] = None,
          compression: Any = None, fragment: Optional[streaming.FragmentSteps] = None,
          model_state: Any = None, download: Optional[bytes] = None, held: Any = None
          ) -> tuple[inner_lib.InnerState, Any, Any, int, Any, Any, Any]:
    """Worker ``worker``'s inner steps on ``batches``: (end state, Δ, mean training loss, this
    process's id, None, the end state's model state). With a ``compressor`` (pickled) and
    the worker's state for it (``compression``): Δ is sent as its ``compress.Message``, and
    the fifth is the next state. With ``fragment`` (a fragment dispatch; ``start`` is then
    None): its steps, and Δ is that of its fragment. ``model_state``: the server's copy the
    worker starts from (``training.model_state``; None: its own, or none). With ``download``
    (a pickled compressor): ``start`` is θ whole, or with ``held`` (the worker's x̂) the
    message it starts from at x̂ + D(m) (``ServerActor.download``); the seventh is that start,
    the worker's next x̂. A fragment dispatch with ``download``: ``start`` is θ whole
    (``held`` None) or the received fragment's message, ``held`` the worker's anchors, and
    the seventh its next anchors (``_received``)."""
    key = jax.random.wrap_key_data(key_data)
    # θ sharded: every array on θ's mesh here (x̂ too, as the server actor keeps it).
    put = self._layout.from_host if self._layout is not None else lambda tree: tree
    if download is not None and held is not None:
      held = put(held)
    if download is not None and fragment is not None:  # the worker keeps its anchors (x̂)
      fragment, held = self._received(fragment, start, download, held)
    elif download is not None and held is not None:  # ALGORITHMS.md, "Compressed downloads"
      start = self._downlinks(download, held).apply(held, start)
    if model_state is not None and previous is not None:
      previous = previous._replace(model_state=model_state)
    if self._layout is not None:
      previous = put(previous)
      if fresh and previous is not None:
        previous = self._inner.fresh_moments(previous)

      def run_worker(worker, previous, start, batches, key, carry=False):
        del worker
        return simulated.compute_worker(self._inner, previous, put(start), put(batches),
                                        put(key), carry)
      if fragment is None:  # a whole dispatch's end state kept as its carry (as the engine's)
        state, delta, loss = run_worker(worker, previous, start, batches, key, carry=True)
      else:
        state, delta, loss = put(fragment).run(run_worker, worker, previous, batches, key)
      to_host = sharding.to_host
    else:
      if fresh and previous is not None:
        previous = self._executor.fresh_moments(previous)
      if fragment is None:
        state, delta, loss = self._executor.run_worker(worker % self._slots, previous, start,
                                                       batches, key, carry=True)
      else:
        state, delta, loss = self._executor.run_fragment(worker % self._slots, previous,
                                                         fragment, batches, key)
      to_host = jax.device_get
    if compressor is not None:  # ALGORITHMS.md, "Compression in a run"
      if self._sending[0] != compressor:
        self._sending = (compressor, jax.jit(functools.partial(compress.send,
                                                               _unpickled(compressor))))
      delta, compression = jax.device_get(self._sending[1](delta, compression))
    else:
      delta, compression = to_host(delta), None
    held = held if fragment is not None else start  # the worker's next x̂
    return (to_host(state), delta, jax.device_get(loss), os.getpid(), compression,
            to_host(state.model_state), None if download is None else to_host(held))

  def _received(self, plan: streaming.FragmentSteps, message: Any, pickled: bytes,
                anchors: Any) -> tuple[streaming.FragmentSteps, Any]:
    """A fragment dispatch's plan with what the worker received compressed: θ whole (its
    anchors, ``anchors`` None: ``message`` is θ) or fragment ``plan.received`` at its anchor
    + D(``message``) (``Downlink.fragment``), and the anchor of the fragment it sends."""
    fragments = plan.fragments
    if anchors is None:
      anchors = message
      plan = dataclasses.replace(plan, start=message)
    else:
      p = plan.received
      assert p is not None
      link = self._downlinks(pickled, fragments.take(anchors, p))
      anchors, arrived = link.received(fragments, anchors, p, message)
      plan = dataclasses.replace(plan, arrived=arrived)
    return dataclasses.replace(plan, anchor=fragments.take(anchors, plan.sent)), anchors


class RayServer:
  """The engine's handle on the parameter-server actor (``OuterServer``'s interface).

  Args:
    actor: the ``ServerActor``.
    layout: θ's layout in this process (the user's mesh) when θ is sharded: what
      it reads back (to evaluate, to checkpoint) is placed there, shard by shard.
  """

  def __init__(self, actor: Any, layout: Optional[sharding.Layout] = None):
    self.actor = actor
    self.layout = layout
    self._ray = import_ray()

  def _here(self, tree: Any) -> Any:
    return tree if self.layout is None else self.layout.from_host(tree)

  @property
  def params(self) -> Any:  # θ alone: what an evaluation needs
    return self._here(self._ray.get(self.actor.get_params.remote()))

  @property
  def outer_state(self) -> Any:
    return self.get()[1]

  def get(self) -> tuple[Any, Any]:
    return self._here(self._ray.get(self.actor.get.remote()))

  def set(self, params: Any, outer_state: Any) -> None:
    self._ray.get(self.actor.set.remote(*sharding.to_host((params, outer_state))))

  def history(self) -> list[float]:
    return self._ray.get(self.actor.history.remote())

  def set_history(self, norms: Any) -> None:
    self._ray.get(self.actor.set_history.remote(list(norms)))

  def dispatch_point(self) -> Any:
    """An object ref: workers fetch it from the server's node, not from here."""
    return self.actor.dispatch_point.remote()

  def update(self, taus: list[int], *deltas: Any, fetch: bool = True,
             weights: Optional[list[float]] = None) -> list[dict]:
    del fetch  # the actor returns Python numbers: its rows come over Ray anyway
    refs = [d.delta if isinstance(d, Dispatch) else sharding.to_host(d) for d in deltas]
    compressors = [d.compressor if isinstance(d, Dispatch) else None for d in deltas]
    return self._ray.get(self.actor.update.remote(
        taus, *refs, weights=weights,
        compressors=compressors if any(c is not None for c in compressors) else None))


@dataclasses.dataclass
class Dispatch:
  """One worker's dispatch on a worker actor; its refs are replaced if it is sent again.

  ``state``, ``delta`` and ``train_loss`` are the end state, Δ and the mean
  training loss (object refs, or values restored from a checkpoint); ``done``
  a small ref that resolves to the computing process's id, or raises if the
  actor is gone for good, when they are ready. ``options``: ``WorkerActor.run``'s keywords
  (a fragment dispatch's steps, the compressor and the worker's state for it). Compressed
  (``compressor``: the compressor, pickled), ``delta`` is the worker's
  ``compress.Message``, ``receive`` decompresses it here, and ``compression`` is the
  worker's next compressor state. ``end_model_state``: the end state's model state (a ref;
  read by ``model_state``); ``receives``: the server's copy of it that the next dispatch
  from this state starts from (``training.model_state.ModelStates.for_dispatch``).
  ``held``: with compressed downloads, the start the worker built (its next x̂; a ref).
  """
  args: tuple = ()
  options: dict = dataclasses.field(default_factory=dict)
  actor: int = -1
  state: Any = None
  delta: Any = None
  train_loss: Any = None
  done: Any = None
  fresh: bool = False
  compression: Any = None
  compressor: Optional[bytes] = None
  receive: Optional[Callable[[Any], Any]] = None
  end_model_state: Any = None
  receives: Any = None
  held: Any = None

  # The end state's handle stands for an ``inner.InnerState`` where ``ModelStates`` reads and
  # replaces its model state, the one part of it the server merges.
  def _replace(self, *, model_state: Any) -> "Dispatch":
    return dataclasses.replace(self, receives=model_state)

  @property
  def model_state(self) -> Any:
    return import_ray().get(self.end_model_state)


@dataclasses.dataclass
class Download:
  """A compressed download (``RayDownlink.start``, ``.whole``, ``.fragment``): ``message``, a
  ref of θ whole or of the message m (with fragments, θ whole is values); ``held``, the x̂
  the worker builds its start from (None: θ whole; the previous ``Download``, whose dispatch
  returned it; or its value, restored from a checkpoint); ``pickled``, the compressor;
  ``dispatch``, the dispatch it starts, whose seventh result is the worker's next x̂ (with
  fragments: its anchors)."""
  message: Any
  held: Any
  pickled: bytes
  dispatch: Optional[Dispatch] = None


class RayDownlink(downlink_lib.Downlink):
  """Compressed downloads on Ray (docs/ALGORITHMS.md, "Compressed downloads"): the server
  actor keeps an x̂ per worker and sends the message (``ServerActor.download``); the worker
  actor keeps its x̂ as its dispatches' seventh result and builds the same start from it; only
  m crosses the object store.

  Args:
    compressor, params: ``Downlink``'s.
    server: the run's ``RayServer``.
    pickled: ``compressor``, pickled for the actors.
  """

  def __init__(self, compressor: compress.Compressor, params: Any, server: Any,
               pickled: bytes, fragments: Any = None):
    super().__init__(compressor, params, fragments)
    self._server, self._pickled = server, pickled

  def start(self, worker: int, point_of: Callable[[], Any], held: Any) -> Download:
    del point_of  # the server actor takes its own dispatch point
    if held is not None and not isinstance(held, Download):  # from a checkpoint: to both actors
      held = sharding.to_host(held)
      self._server.actor.hold.remote(worker, held)  # (an actor runs its calls in order)
    return Download(self._server.actor.download.remote(
        worker, None if held is None else self._pickled), held, self._pickled)

  # With fragments each fragment's server actor keeps its x̂ per worker (the worker's anchor
  # of it), and the worker actor keeps the anchors (``WorkerActor._received``).

  def whole(self, worker: int, server: Any) -> Download:
    fragments = self._split()
    points = import_ray().get([server.fragment(p).actor.download.remote(worker, None)
                               for p in range(fragments.num)])
    return Download(fragments.merge(points), None, self._pickled)

  def fragment(self, worker: int, server: Any, anchors: Any, p: int) -> tuple[Any, Any]:
    if not isinstance(anchors, Download):  # from a checkpoint: to the worker and every actor
      fragments, anchors = self._split(), sharding.to_host(anchors)
      for q in range(fragments.num):
        server.fragment(q).actor.hold.remote(worker, fragments.take(anchors, q))
    download = Download(server.fragment(p).actor.download.remote(worker, self._pickled),
                        anchors, self._pickled)
    return download, download

  def anchor(self, anchors: Any, p: int) -> None:
    del anchors, p  # the worker actor takes it from the anchors it keeps


@dataclasses.dataclass(frozen=True)
class RayOptions:
  """Where the Ray runtime runs (the CLI's ``ray.*`` keys).

  Attributes:
    address: "" starts a local Ray instance; "auto" or "HOST:6379" joins one.
    num_cpus: a local instance's CPUs (None: all of this machine's).
    cpus_per_worker: the CPUs each worker actor reserves (None: Ray's default).
    gpus_per_worker: the GPUs each worker actor owns.
    server_gpus: the parameter server's GPUs (0: it runs on its node's CPU).
    log_to_driver: the actors' stdout/stderr in this terminal.
    slowdown: per worker, a factor >= 1: worker i's result arrives after
      f_i × its compute time (controlled heterogeneity); () = none.
    batch_size: the leading size of a batch, checked at the start against the devices
      each worker splits it over (0: checked at the first dispatch).
    max_restarts: how often Ray restarts a worker actor that died (its task
      then runs again); after that its workers move to a spare, a new actor or the live
      ones. With ``spares`` a dead actor is not restarted: a spare takes its workers.
    replacements: how many new worker actors the run may start in place of actors
      out of restarts (0: their workers move to the live actors).
    devices_per_worker: the devices of its actor each worker's inner steps run
      data-parallel over (θ replicated, the batch split; a TPU host's chips, a GPU
      node's GPUs). 0: the actor's devices shared equally by its workers.
    workers_per_actor: workers each actor runs, each on its own devices (e.g. 2 workers
      of 4 chips on an 8-chip host); the actor runs their dispatches concurrently.
    spares: standby worker actors started with the others, whose inner loop is compiled
      at the first dispatch (docs/FAILURES.md, "Hot spares"): a dead actor's workers move
      to one at once, instead of to an actor that must start and compile.
  """
  address: str = ""
  num_cpus: Optional[int] = None
  cpus_per_worker: Optional[float] = None
  gpus_per_worker: float = 0.0
  server_gpus: float = 0.0
  log_to_driver: bool = False
  slowdown: tuple[float, ...] = ()
  batch_size: int = 0
  max_restarts: int = 3
  replacements: int = 0
  devices_per_worker: int = 0
  workers_per_actor: int = 1
  spares: int = 0

  def __post_init__(self):
    for name in ("devices_per_worker", "workers_per_actor", "spares", "max_restarts",
                 "replacements", "batch_size"):
      value, low = getattr(self, name), 1 if name == "workers_per_actor" else 0
      if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"ray.{name}={value!r} is not allowed; allowed: an integer >= {low}")


# Packages every actor imports itself; functions from any other module are sent by value.
_INSTALLED = ("heloco_jax", "jax", "optax", "flax", "numpy", "functools")


def _send_by_value(fn: Any) -> None:
  """Lets actors unpickle ``fn`` without importing its module (e.g. a user's script or test)."""
  fn = getattr(fn, "func", fn)  # functools.partial
  module = sys.modules.get(getattr(fn, "__module__", None) or "")
  if module is not None and module.__name__ != "__main__" and (
      module.__name__.split(".")[0] not in _INSTALLED):
    from ray import cloudpickle  # pylint: disable=g-import-not-at-top
    cloudpickle.register_pickle_by_value(module)


def _check_reachable(address: str) -> None:
  """A ConnectionError in one line, at once, when nothing listens at ``address`` (HOST:PORT of
  a running cluster's head); ``ray.init`` would otherwise wait for minutes."""
  host, _, port = address.removeprefix("ray://").rpartition(":")
  try:
    socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
  except (OSError, ValueError) as error:
    reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
    raise ConnectionError(
        f"nothing answers at ray.address={address!r} ({reason}); allowed: HOST:PORT of a "
        "running Ray cluster's head (`ray start --head`), 'auto', or '' to start a local "
        "instance") from None


def _check_local_instance_authenticated() -> None:
  """A ValueError in one line when a local instance would run without Ray's token
  authentication: its servers listen on every network interface (Ray 2.60 has no
  loopback-only switch), so without a token anyone who reaches this machine could run code in
  it. Unset, ``RAY_AUTH_MODE`` is ``token`` for a new local instance (Ray's default)."""
  if os.environ.get("RAY_AUTH_MODE", "").strip().lower() == "disabled":
    raise ValueError(
        "runtime=ray: refusing to start a local Ray instance with RAY_AUTH_MODE=disabled: its "
        "servers listen on every network interface, so anyone who reaches this machine could "
        "run code in it; unset RAY_AUTH_MODE (token authentication, Ray's default) or join a "
        "cluster you secured with ray.address=HOST:PORT (docs/DESIGN.md)")


def _make_private_token() -> None:
  """Ray's token for a new local instance, made 0600 before ``ray.init`` would make it 0644.

  Ray (2.60) writes ``~/.ray/auth_token`` with the umask's mode, readable by every user of
  the machine, who could then run code in the instance. Where Ray would make one (token
  mode, no ``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH``, no file yet), this makes it first,
  as Ray does (256 random bits in hex) but 0600 and never through a link; Ray then reads it.
  An existing token file is the user's and is left as it is."""
  import secrets  # pylint: disable=g-import-not-at-top
  if (os.environ.get("RAY_AUTH_MODE", "token").strip().lower() != "token"
      or os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
    return
  path = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
  if os.path.lexists(path):
    return
  os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
  try:
    fd = safe_files.open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  except FileExistsError:  # made meanwhile by another process: theirs
    return
  with os.fdopen(fd, "w") as f:
    f.write(secrets.token_hex(32))


class RayExecutor(simulated.OneProcess):
  """A run's work on Ray actors: ``ray.init`` (or joins ``options.address``), starts them.

  Runs asynchronous methods only (``synchronies``): synchronous ones run SPMD
  with ``runtime="devices"`` and ``jax.distributed``.

  Args:
    inner: the engine's inner loop (this process runs none of it: each worker
      actor builds its own from the same ``loss_fn`` and ``inner_tx``).
    num_workers: K (one actor each).
    options: ``RayOptions``.
  """

  def __init__(self, inner: inner_lib.InnerLoop, num_workers: int,
               options: RayOptions = RayOptions()):
    self.inner = inner
    self.layout = inner.layout
    recipe = self.layout.recipe if self.layout is not None else None
    self.concurrency = num_workers
    ray = self._ray = import_ray()
    self._started = not ray.is_initialized()
    if self._started and options.address not in ("", "auto"):
      _check_reachable(options.address)
    if self._started and not options.address:  # a local instance: docs/DESIGN.md
      _check_local_instance_authenticated()
      _make_private_token()
    if self._started:
      with warnings.catch_warnings():  # Ray forks and at once execs its processes: no hazard
        warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
        ray.init(address=options.address or None, num_cpus=options.num_cpus,
                 include_dashboard=False, log_to_driver=options.log_to_driver,
                 configure_logging=False)
    self.slowdown = options.slowdown or (1.0,) * num_workers
    def resources(cpus, gpus):
      return {k: v for k, v in (("num_cpus", cpus), ("num_gpus", gpus)) if v}
    _send_by_value(inner.loss_fn)
    if recipe is not None and options.workers_per_actor > 1:
      raise ValueError(f"ray.workers_per_actor={options.workers_per_actor} is not allowed with "
                       "params sharded over a mesh; allowed: 1 (each actor's devices take θ's "
                       "mesh)")
    # With spares a dead actor is not restarted: a warm spare takes its workers at once.
    restarts = 0 if options.spares else options.max_restarts
    worker = ray.remote(WorkerActor).options(
        max_restarts=restarts, max_task_retries=restarts,
        max_concurrency=options.workers_per_actor,
        **resources(options.cpus_per_worker, options.gpus_per_worker))
    self._new_actor = functools.partial(worker.remote, inner.loss_fn, inner.tx,
                                        inner.reset_optimizer, recipe,
                                        options.devices_per_worker, options.workers_per_actor)
    self.replacements = options.replacements
    busy = -(-num_workers // options.workers_per_actor)  # actors that run workers
    self.actors = [self._new_actor() for _ in range(busy + options.spares)]
    self._standby = list(range(busy, len(self.actors)))  # spares, not yet warm
    self._warm: list[Any] = []  # the spares' warm-up dispatches (refs)
    # Started (JAX imported, loop built) before the clock starts.
    described = ray.get([actor.describe.remote() for actor in self.actors])
    self.actor_devices = [devices for devices, _, _ in described]
    self._pids = ray.get([actor.pid.remote() for actor in self.actors])
    self.alive = [True] * len(self.actors)
    self._assigned = [w // options.workers_per_actor for w in range(num_workers)]
    self.group_size = described[0][2]
    problem = next((p for _, p, _ in described if p is not None), None)
    if problem is None and options.batch_size and options.batch_size % self.group_size:
      problem = self._unsplit(options.batch_size)
    if problem is not None:
      self.close()
      raise devices_lib.DeviceConfigError(problem)
    self._server_options = resources(0, options.server_gpus)
    self._split_checked = False
    self._emit: Callable[[dict], None] = lambda row: None
    self._clock: Callable[[], float] = lambda: 0.0
    self._pickles: dict[int, tuple[compress.Compressor, bytes]] = {}  # id -> its bytes

  def to_server(self, tree: Any) -> Any:
    """A value the driver keeps beside θ (the model state's server copy): with θ sharded, on
    θ's layout here, host shards from an actor included."""
    return tree if self.layout is None else self.layout.from_host(tree)

  def make_server(self, outer_tx: Any, params: Any, **options: Any) -> RayServer:
    """The server actor, on the driver's node where it fits there (θ is never lost with a
    worker's node; soft: elsewhere when the node lacks ``server_gpus``)."""
    from ray.util import scheduling_strategies  # pylint: disable=g-import-not-at-top
    here = scheduling_strategies.NodeAffinitySchedulingStrategy(
        self._ray.get_runtime_context().get_node_id(), soft=True)
    actor = self._ray.remote(ServerActor).options(
        scheduling_strategy=here, **self._server_options).remote(
            outer_tx, sharding.to_host(params), options,
            self.layout.recipe if self.layout is not None else None)
    return RayServer(actor, self.layout)

  synchronies = frozenset({"async"})
  compresses = compresses_downloads = True

  def make_downlink(self, compressor: compress.Compressor, params: Any, server: Any,
                    fragments: Any) -> RayDownlink:
    return RayDownlink(compressor, params, server, self._pickled(compressor), fragments)

  def watch(self, clock: Callable[[], float], emit: Callable[[dict], None]) -> None:
    """Where restart and re-send rows go, with the run's clock (set by the arrival queue)."""
    self._clock, self._emit = clock, emit

  def describe(self) -> str:
    sharded = (f", θ sharded over {dict(self.layout.mesh.shape)} in each actor"
               if self.layout is not None else "")
    spares = f", {len(self._standby)} spare(s)" if self._standby else ""
    return (f"Ray worker actors ({'/'.join(str(len(d)) for d in self.actor_devices)} "
            f"{self.actor_devices[0][0].split(':')[0]} devices each, "
            f"{self.group_size} per worker{sharded}{spares})")

  def _unsplit(self, batch: int) -> str:
    return (f"a batch of {batch} does not split over each worker's {self.group_size} devices "
            "on Ray; allowed: a batch size that is a multiple of ray.devices_per_worker "
            f"(= {self.group_size}), or ray.devices_per_worker that divides it")

  def _check_split(self, batches: Any) -> None:
    """A ValueError in one line, at the first dispatch, when the batch (``batches``: H steps'
    batches, each (B, ...)) does not split over a worker's devices."""
    if self._split_checked or self.layout is not None:
      return
    sizes = {np.shape(x)[1] for x in jax.tree.leaves(batches) if np.ndim(x) > 1}
    for size in sizes:
      if size % self.group_size:
        raise devices_lib.DeviceConfigError(self._unsplit(size))
    self._split_checked = True

  def run_worker(self, worker, previous, start, batches, key, carry=False):
    """Worker ``worker``'s dispatch, returned three times (the handles of the end state, Δ
    and the training loss); ``transmit`` sends it to the worker's actor (which keeps the
    ``carry`` of a whole dispatch's end state whatever ``carry`` says: ``WorkerActor.run``
    asks its executor for it)."""
    del carry
    fresh = isinstance(previous, Dispatch) and previous.fresh
    options = {}
    if isinstance(previous, Dispatch):
      if previous.receives is not None:
        options["model_state"] = sharding.to_host(previous.receives)
      previous = previous.state
    else:  # a restored state, on this process's devices
      previous = sharding.to_host(previous)
    download = start if isinstance(start, Download) else None
    if download is not None:  # the worker builds its start from the message
      held = download.held
      options.update(download=download.pickled,
                     held=held.dispatch.held if isinstance(held, Download) else held)
      start = download.message
    self._check_split(batches)
    dispatch = Dispatch(args=(worker, start, previous, batches,
                              np.asarray(jax.random.key_data(key)), fresh), options=options)
    if download is not None:  # (the previous download is the worker's no more: no chain)
      download.dispatch, download.held = dispatch, None
    return dispatch, dispatch, dispatch

  def run_fragment(self, worker, previous, steps, batches, key):
    """A fragment dispatch (``streaming.FragmentSteps``, its arrays on the host): the worker's
    actor runs all of it, the arrived fragment's merge included. Downloads compressed
    (``steps.start`` or ``steps.arrived`` a ``Download``): the actor builds them from the
    anchors it keeps."""
    download = next((x for x in (steps.start, steps.arrived) if isinstance(x, Download)), None)
    if download is not None:
      steps = dataclasses.replace(steps, start=None, arrived=None)
    dispatch, _, _ = self.run_worker(worker, previous, download, batches, key)
    dispatch.options["fragment"] = jax.device_get(steps)
    return dispatch, dispatch, dispatch

  def transmit(self, uplink, fragment, delta, state):
    """Sends ``delta``'s dispatch to its worker's actor, with the compressor and the worker's
    state for it when Δ is compressed (the actor sends its message; ``ServerActor.update``
    decompresses it). The worker's next state: the same dispatch (``fetch``'s
    "compression")."""
    dispatch = delta
    if uplink.compressor is not None:
      dispatch.compressor = self._pickled(uplink.compressor)
      dispatch.receive = functools.partial(uplink.receive, fragment=fragment)
      if isinstance(state, Dispatch):
        state = state.compression
      dispatch.options.update(compressor=dispatch.compressor, compression=state)
      state = dispatch
    self._submit(dispatch, self._assigned[dispatch.args[0]])
    return dispatch, state

  def _pickled(self, compressor: compress.Compressor) -> bytes:
    if id(compressor) not in self._pickles:
      from ray import cloudpickle  # pylint: disable=g-import-not-at-top
      for fn in compressor:  # a user's compressor: its module need not be installed
        _send_by_value(fn)
      self._pickles[id(compressor)] = (compressor, cloudpickle.dumps(compressor))
    return self._pickles[id(compressor)][1]

  def _submit(self, dispatch: Dispatch, actor: int) -> None:
    dispatch.actor = actor
    (dispatch.state, dispatch.delta, dispatch.train_loss, dispatch.done, dispatch.compression,
     dispatch.end_model_state, dispatch.held) = self.actors[actor].run.options(
         num_returns=7).remote(*dispatch.args, **dispatch.options)
    if self._standby and not self._warm:  # the spares compile on the first dispatch's inputs
      self._warm = [self.actors[a].run.options(num_returns=7).remote(
          *dispatch.args, **dispatch.options)[3] for a in self._standby]

  def actor_of(self, worker: int) -> Any:
    """The actor that runs worker ``worker``'s dispatches now."""
    return self.actors[self._assigned[worker]]

  def _computed(self, dispatch: Dispatch, pid: int) -> None:
    """Notes the process that computed ``dispatch``: a new one means its actor restarted."""
    actor = dispatch.actor
    if self._pids[actor] is None:  # a replacement's first result
      self._pids[actor] = pid
    elif pid != self._pids[actor]:
      self._pids[actor] = pid
      self._emit({"event": "actor_restarted", "worker": dispatch.args[0], "actor": actor,
                  "sim_time": self._clock()})

  def redispatch(self, dispatch: Dispatch, failed: Any) -> None:
    """``dispatch``'s actor is gone for good (its ref ``failed`` raised): sends the dispatch
    again to the live actor running the fewest workers. Does nothing when ``failed`` is
    not the dispatch's current ref (another caller has already sent it again)."""
    if dispatch.done is not failed:
      return
    worker, lost = dispatch.args[0], dispatch.actor
    self.alive[lost] = False  # out of restarts: Ray has ended it; nothing is killed here
    if self._standby:  # a warm spare in its place (docs/FAILURES.md, "Hot spares")
      actor, event = self._standby.pop(0), "spare_took_over"
    elif self.replacements > 0:  # a new actor in its place (it starts while the task waits)
      self.replacements -= 1
      self.actors.append(self._new_actor())
      self.alive.append(True)
      self._pids.append(None)
      actor, event = len(self.actors) - 1, "actor_added"
    else:
      live = [a for a, ok in enumerate(self.alive) if ok]
      if not live:
        raise RuntimeError("runtime=ray: every worker actor has died; the last checkpoint "
                           "holds the run (re-run the same command to resume)")
      actor = min(live, key=lambda a: (self._assigned.count(a), a))
      event = "redispatched"
    for w, a in enumerate(self._assigned):
      if a == lost:
        self._assigned[w] = actor
    self._submit(dispatch, actor)
    self._emit({"event": event, "worker": worker, "lost_actor": lost, "actor": actor,
                "sim_time": self._clock()})

  async def wait(self, dispatch: Any) -> None:
    """Returns once ``dispatch`` is computed, sending it again while its actor is dead."""
    while isinstance(dispatch, Dispatch):
      done = dispatch.done
      try:
        pid = await done
      except self._ray.exceptions.RayActorError:
        self.redispatch(dispatch, done)
        continue
      if dispatch.done is done:
        self._computed(dispatch, pid)
      return

  def fetch(self, tree: Any, what: str) -> Any:
    """Worker states (``what="state"``), a pending Δ (``"delta"``), a training loss
    (``"train_loss"``), a worker's compressor state (``"compression"``), a server actor's
    dispatch point (``"point"``, an object ref) or a worker's x̂ (``"held"``) as values,
    waiting for them."""
    here = (self.layout.from_host if self.layout is not None
            and what in ("state", "delta", "held") else lambda tree: tree)
    if what == "held" and not isinstance(tree, Dispatch):  # (the driver's: host shards)
      return here([self._held(d) for d in tree] if isinstance(tree, list) else self._held(tree))
    def value(dispatch):
      if isinstance(dispatch, self._ray.ObjectRef):
        return self._ray.get(dispatch)
      if not isinstance(dispatch, Dispatch):
        return dispatch
      while True:
        done = dispatch.done
        try:
          value = self._ray.get(getattr(dispatch, what))
        except self._ray.exceptions.RayActorError:
          self.redispatch(dispatch, done)
          continue
        if what == "delta" and dispatch.receive is not None:  # Δ as the server receives it
          value = dispatch.receive(value)
        return here(value)
    return [value(d) for d in tree] if isinstance(tree, list) else value(tree)

  def _held(self, download: Any) -> Any:
    """A worker's x̂: what its download's dispatch built (that of the one before when the
    download's dispatch was lost: the worker left, and x̂ is not read again), or a value."""
    if not isinstance(download, Download):
      return download
    if download.dispatch is not None:
      return self.fetch(download.dispatch, "held")
    if download.held is None:  # θ whole
      message = download.message
      return self._ray.get(message) if isinstance(message, self._ray.ObjectRef) else message
    return self._held(download.held)

  def fresh_moments(self, state: Any) -> Any:
    if isinstance(state, Dispatch):  # the worker's actor resets them at its next dispatch
      return dataclasses.replace(state, fresh=True)
    return self.inner.fresh_moments(state)

  def close(self) -> None:
    """Stops the actors (and the local Ray instance this runtime started)."""
    for actor in self.actors:
      try:
        self._ray.kill(actor, no_restart=True)
      except Exception:  # pylint: disable=broad-except  (gone with its node: nothing to stop)
        pass
    if self._started:
      self._ray.shutdown()


def ray_arrivals(clock: clocks.RealClock, executor: RayExecutor,
                 emit: Callable[[dict], None]) -> "RayArrivals":
  """The queue of Ray dispatches in flight; restarts and re-sends are emitted as rows."""
  executor.watch(clock.now, emit)
  return RayArrivals(clock.now, executor.slowdown, executor, clock.transit)


class RayArrivals(devices_lib.DeviceArrivals):
  """Arrivals of Ray dispatches, in the order the actors finish them (re-sent on death)."""

  def __init__(self, clock: Callable[[], float], slowdown: tuple[float, ...],
               runtime: RayExecutor, transit: Callable[[int], float] = lambda worker: 0.0):
    super().__init__(clock, slowdown, transit)
    self._runtime = runtime

  async def _ready(self, worker: int, job: Any) -> None:
    del worker
    await self._runtime.wait(job.delta)
    await asyncio.sleep(0)
