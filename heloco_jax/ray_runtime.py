"""``runtime=ray``: a parameter server and workers as Ray actors, on one or many machines.

DESIGN.md, "Runtimes". The scheduler (``heloco_jax.scheduler``) runs the
asynchronous methods here exactly as on the other runtimes; only where things
live changes:

  * the parameter-server actor (``OuterServer``, ``heloco_jax.server``) holds
    θ, the outer state and the jitted outer rule. The scheduler sends it each
    arrival group's pseudo-gradients as object refs (they go from the worker's
    node to the server's, not through the scheduler) and reads θ back only to
    evaluate and to checkpoint;
  * one worker actor per worker owns its accelerators (``ray.gpus_per_worker``;
    with several devices its batch is split over them, as on
    ``runtime=devices``) and its own copy of the data: a dispatch sends the
    start point (an object ref of the server's dispatch point), the worker's
    previous inner state, its data iterator's position and a PRNG key;
  * the asyncio scheduler awaits the actors' object refs and takes arrivals
    in the order they finish, on the real clock.

Worker death: a dispatch whose actor died (or dies while computing) is sent
again, with the same inputs, to the live actor that runs the fewest workers,
and a ``{"event": "redispatched"}`` row in ``metrics.jsonl`` counts it. θ
lives on the server and is never touched by a worker's death; the run stops
with an error only when no worker actor is left.

Synchronous methods do not run here: across processes they run SPMD with
``jax.distributed`` (``distributed.*`` keys, ``heloco_jax.distributed``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import warnings
from typing import Any, Callable, Optional

import jax
import ml_collections
import numpy as np

from heloco_jax import devices as devices_lib, inner as inner_lib, server as server_lib

INSTALL_HINT = "pip install 'heloco-jax[ray]'"


def import_ray():
  """The ``ray`` module, or an ImportError saying how to install it."""
  try:
    import ray  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError(f"config.runtime='ray' needs Ray: {INSTALL_HINT}") from None
  return ray


class ServerActor(server_lib.OuterServer):
  """The parameter server as a Ray actor: what it returns goes to the host first."""

  def __init__(self, config: ml_collections.ConfigDict, params: Any):
    super().__init__(config, params, place=jax.device_put)

  def dispatch_point(self) -> Any:
    return jax.device_get(super().dispatch_point())

  def get_params(self) -> Any:
    return jax.device_get(self.params)


class WorkerActor:
  """One Ray worker: the compiled inner loop on this actor's devices and its own data."""

  def __init__(self, config: ml_collections.ConfigDict):
    from heloco_jax import model as model_lib, scheduler  # pylint: disable=g-import-not-at-top
    graphdef, _ = model_lib.init(model_lib.config_from(config.model), config.seed)
    self._data = scheduler.make_dataset(config)
    inner = scheduler.make_inner_loop(config, graphdef)
    devices = jax.devices()
    if len(devices) > 1 and config.batch_size % len(devices) == 0:  # data-parallel inside
      groups = devices_lib.group_devices(1, config.batch_size, devices=devices)
      self._placement = devices_lib.DevicePlacement(inner, groups)
    else:
      self._placement = devices_lib.HostPlacement(inner)
    self._iterators: dict[int, Any] = {}

  def devices(self) -> list[str]:
    return [f"{d.platform}:{d.id}" for d in jax.devices()]

  def run(self, worker: int, start: Any, previous: Optional[inner_lib.InnerState],
          position: Any, steps: int, key_data: np.ndarray,
          fresh: bool) -> tuple[inner_lib.InnerState, Any, int]:
    """Worker ``worker``'s ``steps`` inner steps: (end state, Δ, steps) on the host."""
    iterator = self._iterators.setdefault(worker, self._data.worker_iterator(worker))
    iterator.set_state(position)
    batches = np.stack([next(iterator) for _ in range(steps)])
    if fresh and previous is not None:
      previous = self._placement.fresh_moments(previous)
    state, delta = self._placement.run_worker(worker, previous, start, batches,
                                              jax.random.wrap_key_data(key_data))
    return jax.device_get(state), jax.device_get(delta), steps


class RayServer:
  """The scheduler's handle on the parameter-server actor (``OuterServer``'s interface)."""

  def __init__(self, actor: Any):
    self.actor = actor
    self._ray = import_ray()

  @property
  def params(self) -> Any:  # θ alone: what an evaluation needs
    return self._ray.get(self.actor.get_params.remote())

  @property
  def outer_state(self) -> Any:
    return self.get()[1]

  def get(self) -> tuple[Any, Any]:
    return self._ray.get(self.actor.get.remote())

  def set(self, params: Any, outer_state: Any) -> None:
    self._ray.get(self.actor.set.remote(params, outer_state))

  def dispatch_point(self) -> Any:
    """An object ref: workers fetch it from the server's node, not from here."""
    return self.actor.dispatch_point.remote()

  def update(self, taus: list[int], poisons: list[Optional[str]], *deltas: Any,
             fetch: bool = True) -> list[dict]:
    del fetch  # the actor returns Python numbers: its rows come over Ray anyway
    refs = [d.delta if isinstance(d, Dispatch) else d for d in deltas]
    return self._ray.get(self.actor.update.remote(taus, poisons, *refs))


@dataclasses.dataclass
class Dispatch:
  """One worker's dispatch on a worker actor; its refs are replaced if it is sent again.

  ``state`` and ``delta`` are the end state and Δ (object refs, or values
  restored from a checkpoint); ``done`` a small ref that resolves, or raises
  if the actor died, when both are ready.
  """
  args: tuple = ()
  actor: int = -1
  state: Any = None
  delta: Any = None
  done: Any = None
  fresh: bool = False


class RayPlacement(devices_lib.HostPlacement):
  """Places a run on Ray actors: ``ray.init`` (or joins ``ray.address``), starts them.

  Args:
    config: the run's config (``ray.*``, ``devices.slowdown``, ``num_workers``).
    inner: the scheduler's inner loop (the scheduler's process runs none of it).
  """

  real_clock = True
  reads_own_data = True

  def __init__(self, config: ml_collections.ConfigDict, inner: inner_lib.InnerLoop):
    super().__init__(inner)
    ray = self._ray = import_ray()
    self._started = not ray.is_initialized()
    if self._started:
      with warnings.catch_warnings():  # Ray forks and at once execs its processes: no hazard
        warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
        ray.init(address=config.ray.address or None, num_cpus=config.ray.num_cpus or None,
                 include_dashboard=False, log_to_driver=config.ray.log_to_driver,
                 configure_logging=False)
    self.config = config
    self.slowdown = devices_lib.slowdown_factors(config.devices.slowdown, config.num_workers)
    resources = lambda cpus, gpus: {k: v for k, v in (("num_cpus", cpus), ("num_gpus", gpus))
                                    if v > 0}
    worker = ray.remote(WorkerActor).options(
        **resources(config.ray.cpus_per_worker, config.ray.gpus_per_worker))
    self.actors = [worker.remote(config) for _ in range(config.num_workers)]
    # Started (JAX imported, data built) before the clock starts.
    self.actor_devices = ray.get([actor.devices.remote() for actor in self.actors])
    self._server_options = resources(0, config.ray.server_gpus)
    self.alive = [True] * len(self.actors)
    self._assigned = list(range(config.num_workers))  # worker -> actor
    self._emit: Callable[[dict], None] = lambda row: None
    self._clock: Callable[[], float] = lambda: 0.0

  def make_server(self, config: ml_collections.ConfigDict, params: Any) -> RayServer:
    actor = self._ray.remote(ServerActor).options(**self._server_options).remote(
        config, jax.device_get(params))
    return RayServer(actor)

  def arrivals(self, clock: Callable[[], float], emit: Callable[[dict], None]) -> "RayArrivals":
    self._clock, self._emit = clock, emit
    return RayArrivals(clock, self.slowdown, self)

  def run_worker(self, worker, previous, start, batches, key, position=None):
    """Sends the dispatch to worker ``worker``'s actor; returns (its Dispatch, the same)."""
    fresh = isinstance(previous, Dispatch) and previous.fresh
    if isinstance(previous, Dispatch):
      previous = previous.state
    dispatch = Dispatch(args=(worker, start, previous, position, len(batches),
                              np.asarray(jax.random.key_data(key)), fresh))
    self._submit(dispatch, self._assigned[worker])
    return dispatch, dispatch

  def _submit(self, dispatch: Dispatch, actor: int) -> None:
    dispatch.actor = actor
    dispatch.state, dispatch.delta, dispatch.done = self.actors[actor].run.options(
        num_returns=3).remote(*dispatch.args)

  def kill_worker(self, worker: int) -> None:
    """Kills worker ``worker``'s actor (``fault.kill_worker``: tests of worker death)."""
    self._ray.kill(self.actors[self._assigned[worker]], no_restart=True)

  def redispatch(self, dispatch: Dispatch) -> None:
    """``dispatch``'s actor died: sends it again to the live actor running the fewest workers."""
    worker, lost = dispatch.args[0], dispatch.actor
    if self.alive[lost]:
      self.alive[lost] = False
      self._ray.kill(self.actors[lost], no_restart=True)
    live = [a for a, ok in enumerate(self.alive) if ok]
    if not live:
      raise RuntimeError("runtime=ray: every worker actor has died; the last checkpoint "
                         "holds the run (re-run the same command to resume)")
    actor = min(live, key=lambda a: (self._assigned.count(a), a))
    for w, a in enumerate(self._assigned):
      if a == lost:
        self._assigned[w] = actor
    self._submit(dispatch, actor)
    self._emit({"event": "redispatched", "worker": worker, "lost_actor": lost, "actor": actor,
                "sim_time": self._clock()})

  async def wait(self, dispatch: Any) -> None:
    """Returns once ``dispatch`` is computed, sending it again while its actor is dead."""
    while isinstance(dispatch, Dispatch):
      try:
        await dispatch.done
        return
      except self._ray.exceptions.RayActorError:
        self.redispatch(dispatch)

  def fetch(self, tree: Any, what: str) -> Any:
    """Worker states (``what="state"``) or a pending Δ as values, waiting for them."""
    def value(dispatch):
      if not isinstance(dispatch, Dispatch):
        return dispatch
      while True:
        try:
          return self._ray.get(getattr(dispatch, what))
        except self._ray.exceptions.RayActorError:
          self.redispatch(dispatch)
    return [value(d) for d in tree] if isinstance(tree, list) else value(tree)

  def fresh_moments(self, state: Any) -> Any:
    if isinstance(state, Dispatch):  # the worker's actor resets them at its next dispatch
      return dataclasses.replace(state, fresh=True)
    return super().fresh_moments(state)

  def close(self) -> None:
    """Stops the actors (and the local Ray instance this placement started)."""
    for actor in self.actors:
      self._ray.kill(actor, no_restart=True)
    if self._started:
      self._ray.shutdown()


class RayArrivals(devices_lib.DeviceArrivals):
  """Arrivals of Ray dispatches, in the order the actors finish them (re-sent on death)."""

  def __init__(self, clock: Callable[[], float], slowdown: tuple[float, ...],
               placement: RayPlacement):
    super().__init__(clock, slowdown)
    self._placement = placement

  async def _ready(self, worker: int, job: Any) -> None:
    del worker
    await self._placement.wait(job.delta)
    await asyncio.sleep(0)
