"""``runtime="devices"``: each worker on its own group of real devices, real time.

docs/DESIGN.md, "Runtimes". Worker i owns a disjoint group of
``jax.devices()``. Its inner loop is compiled for its group's mesh (axis
``data``): θ and the optimizer state are replicated on the group and every
batch is split over it, so a worker with more devices is faster. The
server's θ, outer state and outer step live on one chosen device.
Synchronous methods stack the K replicas on a ``workers`` × ``data`` mesh and
run them as one program (``vmap`` partitioned by XLA over ``workers``); DDP
splits its K·B batch over all the workers' devices. Time is the real clock
(``heloco_jax.runtime.clocks.RealClock``), and asynchronous arrivals
(``DeviceArrivals``) are taken in the order the devices finish them. With
``jax.distributed`` (``initialize_distributed``) the groups come from every
process's devices and synchronous methods run SPMD: θ replicated on the
workers × data mesh, the outer step in every process. When θ is sharded
(``heloco_jax.training.sharding``), each worker's group is a sub-mesh of θ's mesh's
shape and axis names, its states keep θ's specs there, and its Δ moves to θ's
mesh shard by shard; rounds split the stacked replicas over a ``workers`` axis
of a ``workers`` × θ's axes mesh (docs/DESIGN.md, "Scaling out").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import math
import time
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from heloco_jax.comm import syncer as syncer_lib
from heloco_jax.runtime import base, clocks, simulated
from heloco_jax.training import inner as inner_lib
from heloco_jax.training import server as server_lib


class DeviceConfigError(base.SettingError):
  """``config.devices`` does not fit the devices this process has."""


def _numbers(key: str, value: Any, num_workers: int, kind: type) -> Optional[list]:
  """"2,2,4" (or a list) as ``num_workers`` numbers; None for ""."""
  if value in ("", None):
    return None
  items = value.split(",") if isinstance(value, str) else list(value)
  try:
    numbers = [kind(x) for x in items]
  except (TypeError, ValueError):
    raise DeviceConfigError(f"config.{key}={value!r} is not allowed; allowed: "
                            f"{num_workers} comma-separated numbers, one per worker") from None
  if len(numbers) != num_workers:
    raise DeviceConfigError(f"config.{key}={value!r} is not allowed; allowed: one number per "
                            f"worker ({num_workers}), got {len(numbers)}")
  return numbers


def slowdown_factors(slowdown: Any, num_workers: int) -> tuple[float, ...]:
  """``devices.slowdown`` ("" or K factors ≥ 1) as K factors (runtime=devices and ray)."""
  factors = _numbers("devices.slowdown", slowdown, num_workers, float) or [1.0] * num_workers
  if min(factors) < 1.0:
    raise DeviceConfigError(f"config.devices.slowdown={slowdown!r} is not allowed; allowed: "
                            "factors ≥ 1 (1 = full speed)")
  return tuple(factors)


@dataclasses.dataclass(frozen=True)
class DeviceGroups:
  """The workers' disjoint device groups, the server's device and per-worker slow-downs."""
  groups: tuple[tuple[jax.Device, ...], ...]
  server: jax.Device
  slowdown: tuple[float, ...]


def _unequal_groups(sizes: Sequence[int]) -> DeviceConfigError:
  return DeviceConfigError(
      f"config.devices.group_sizes={list(sizes)} is not allowed for a synchronous method; "
      "allowed: equal group sizes (the replicas are stacked on one workers × data mesh)")


def group_devices(num_workers: int, batch_size: int, group_sizes: Any = "",
                  server: int = 0, slowdown: Any = "",
                  devices: Optional[Sequence[jax.Device]] = None,
                  synchronous: bool = False) -> DeviceGroups:
  """Splits ``devices`` (default ``jax.devices()``) into one group per worker.

  Args:
    num_workers: K.
    batch_size: sequences per inner step; each group splits it, so it must be
      a multiple of every group's size.
    group_sizes: "" (the devices split evenly; leftovers unused) or K sizes,
      e.g. "1,1,2,4", taken in ``jax.devices()`` order.
    server: index into ``devices`` of the device holding θ and the outer state.
    slowdown: "" or K factors ≥ 1: worker i waits (f_i − 1)× its compute
      time before its result arrives (controlled heterogeneity).
    devices: the devices to use.
    synchronous: the method runs rounds, so every group must have the same size.

  Raises:
    DeviceConfigError: naming the key, the value and what is allowed.
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = _numbers("devices.group_sizes", group_sizes, num_workers, int)
  if sizes is None:
    if len(devices) < num_workers:
      raise DeviceConfigError(
          f"config.runtime='devices' needs a device per worker: num_workers={num_workers} but "
          f"this process has {len(devices)} device(s); lower "
          "num_workers or, on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N")
    sizes = [len(devices) // num_workers] * num_workers
  if min(sizes) < 1 or sum(sizes) > len(devices):
    raise DeviceConfigError(
        f"config.devices.group_sizes={group_sizes!r} is not allowed; allowed: sizes ≥ 1 adding "
        f"up to at most the {len(devices)} device(s) of this process")
  for size in sizes:
    if batch_size % size:
      raise DeviceConfigError(
          f"config.batch_size={batch_size} is not allowed with devices.group_sizes "
          f"{sizes}; allowed: a multiple of every group's size (each group splits the batch)")
  if not 0 <= server < len(devices):
    raise DeviceConfigError(f"config.devices.server={server} is not allowed; allowed: 0 to "
                            f"{len(devices) - 1} (an index into jax.devices())")
  if synchronous and len(set(sizes)) > 1:
    raise _unequal_groups(sizes)
  factors = slowdown_factors(slowdown, num_workers)
  bounds = np.cumsum([0, *sizes])
  groups = tuple(tuple(devices[a:b]) for a, b in zip(bounds, bounds[1:]))
  return DeviceGroups(groups, devices[server], factors)


def initialize_distributed(coordinator: Optional[str], num_processes: Optional[int] = None,
                           process_id: Optional[int] = None, timeout_s: float = 60.0) -> None:
  """``jax.distributed.initialize`` (before any other JAX call); nothing without a coordinator.

  "auto" lets JAX find the coordinator (Cloud TPU VMs, SLURM, Open MPI);
  HOST:PORT with ``num_processes`` and ``process_id`` names it. With HOST:PORT the processes
  first wait for each other at most ``timeout_s`` (``processes.roll_call``: one line naming
  the missing process ids, or a second process 0; docs/FAILURES.md, "Several processes"),
  then JAX connects them, within ``timeout_s`` again.

  Raises:
    processes.ProcessesError: a process did not arrive in time, or one refused the others.
  """
  if not coordinator:
    return
  from heloco_jax.rundir import processes  # pylint: disable=g-import-not-at-top
  wait = max(1, math.ceil(timeout_s))
  if coordinator == "auto":
    jax.distributed.initialize(initialization_timeout=wait)
  else:
    processes.roll_call(coordinator, num_processes, process_id, timeout_s)
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                               initialization_timeout=wait)


class DeviceExecutor(simulated.OneProcess):
  """Each worker on its own device group, the server on one device (``runtime=devices``).

  Runs the same computations as ``simulated.LocalExecutor`` on inputs placed
  on the worker's (or all workers') devices.

  Args:
    inner: the workers' compiled inner loop.
    groups: the device groups (``group_devices``).
  """

  def __init__(self, inner: inner_lib.InnerLoop, groups: DeviceGroups):
    self.inner = inner
    self.groups = groups
    self.concurrency = len(groups.groups)
    self.layout = inner.layout
    if self.layout is not None:
      self._init_sharded()
      return
    meshes = [Mesh(np.array(group), ("data",)) for group in groups.groups]
    self._replicated = [NamedSharding(mesh, P()) for mesh in meshes]
    self._split = [NamedSharding(mesh, P(None, "data")) for mesh in meshes]  # (H, B, T)
    sizes = {len(group) for group in groups.groups}
    self._round_mesh = None
    if len(sizes) == 1:  # synchronous methods: one program on a workers × data mesh
      self._round_mesh = Mesh(np.array(groups.groups), ("workers", "data"))
    # Unequal groups run asynchronous methods only (the replicas cannot be stacked).
    self.synchronies = base.SYNCHRONIES if self._round_mesh is not None else frozenset({"async"})
    self.process_count = jax.process_count()
    self.multiprocess = self.process_count > 1
    self._round_delta = jax.jit(simulated.round_delta)
    if self.multiprocess:
      # jax.distributed (synchronous methods): everything lives on the one workers × data
      # mesh, θ replicated and the outer step SPMD, so that no array ever moves between
      # meshes (an eager reshard across processes can deadlock).
      self.require_round_mesh()
      self._server = NamedSharding(self._round_mesh, P())
      self._ddp = (self._server, NamedSharding(self._round_mesh, P(None, ("workers", "data"))))
      # A round's Δ straight onto the server's sharding, in the same program.
      self._round_delta = jax.jit(simulated.round_delta, out_shardings=self._server)
    else:
      self._server = jax.sharding.SingleDeviceSharding(groups.server)
      everything = Mesh(np.array([d for group in groups.groups for d in group]), ("data",))
      self._ddp = (NamedSharding(everything, P()), NamedSharding(everything, P(None, "data")))

  def _init_sharded(self) -> None:
    """Sharded θ (docs/DESIGN.md, "Scaling out"): worker i's group is a sub-mesh with θ's
    mesh's shape and axis names, its states keep θ's specs there; the server holds θ where
    the user put it. Rounds (and DDP steps) run on a ``workers`` × θ's axes mesh of all the
    groups, the K replicas split over ``workers``. In one process."""
    mesh = self.layout.mesh
    sizes = [len(group) for group in self.groups.groups]
    if any(size != mesh.size for size in sizes):
      raise DeviceConfigError(
          f"config.devices.group_sizes={sizes} is not allowed with params sharded over a mesh "
          f"of {mesh.size} devices {dict(mesh.shape)}; allowed: {mesh.size} devices per worker "
          "(each group takes the mesh's shape)")
    groups = [np.array(group).reshape(mesh.devices.shape) for group in self.groups.groups]
    self._workers = [self.layout.on(Mesh(group, mesh.axis_names)) for group in groups]
    self._inners = [self.inner.with_layout(layout) for layout in self._workers]
    self._round_mesh = Mesh(np.stack(groups), ("workers", *mesh.axis_names))
    self._rounds = self.layout.on(self._round_mesh, stack_axis="workers")
    self.inner = self.inner.with_layout(self._rounds, spmd_axis_name="workers")
    self.synchronies = base.SYNCHRONIES
    self.process_count = jax.process_count()
    self.multiprocess = self.process_count > 1
    # Across processes (synchronous methods, SPMD) θ lives on the round mesh, θ's specs
    # replicated over ``workers``, so that every process takes part in every program.
    self._server_layout = self._rounds if self.multiprocess else self.layout
    self._round_delta = jax.jit(simulated.round_delta)
    self._by_worker = NamedSharding(self._round_mesh, P("workers"))
    self._ddp_batches = NamedSharding(self._round_mesh, P(None, "workers"))  # (H, K·B, ...)

  compresses = True  # on each worker's devices; only the messages cross (ALGORITHMS.md)

  @property
  def compresses_downloads(self) -> bool:
    """The engine sends θ and the worker's devices receive it: asynchronous methods, which
    run in one process."""
    return not self.multiprocess

  def make_server(self, outer_tx: Any, params: Any, **options: Any) -> server_lib.OuterServer:
    layout = self._server_layout if self.layout is not None else None
    return server_lib.OuterServer(outer_tx, params, place=self.to_server, layout=layout,
                                  **options)

  def fresh_moments(self, state: inner_lib.InnerState) -> inner_lib.InnerState:
    return self.inner.fresh_moments(state)

  def close(self) -> None:
    pass

  def describe(self) -> str:
    groups = self.groups
    server = (f"θ replicated over {self.process_count} processes" if self.multiprocess
              else f"server on {groups.server}")
    if self.layout is not None:
      server = f"θ sharded over {dict(self.layout.mesh.shape)}, each worker's group alike"
    return (f"workers on devices ({'/'.join(str(len(g)) for g in groups.groups)} "
            f"{groups.server.platform} devices each, {server})")

  def require_round_mesh(self) -> None:
    if self._round_mesh is None:
      raise _unequal_groups([len(g) for g in self.groups.groups])

  def _put(self, tree: Any, sharding: jax.sharding.Sharding) -> Any:
    """``jax.device_put``; across processes, host-local leaves go through the host."""
    if not self.multiprocess:
      return jax.device_put(tree, sharding)
    def put(x):
      spread = isinstance(x, jax.Array) and len(x.sharding.device_set) > 1
      owners = {d.process_index for d in x.sharding.device_set} if spread else set()
      if len(owners) == 1 and x.sharding.device_set != sharding.device_set:
        # One process's devices (a sharded θ on one worker's group, once, at the start):
        # JAX moves it to other processes' devices only through the host; every process
        # takes this branch alike.
        owner = jax.process_index() in owners
        value = np.asarray(x) if owner else np.zeros(x.shape, x.dtype)
        return jax.device_put(
            np.asarray(multihost_utils.broadcast_one_to_all(value, is_source=owner)), sharding)
      if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, sharding)  # already global: reshard
      if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(
            jax.device_put(np.asarray(jax.random.key_data(x)), sharding))
      return jax.device_put(np.asarray(x), sharding)  # the same value in every process
    return jax.tree.map(put, tree)

  def to_server(self, tree: Any) -> Any:
    if self.layout is not None:  # device to device, shard by shard
      return self._put_layout(tree, self._server_layout)
    return self._put(tree, self._server)

  def _put_layout(self, tree: Any, layout: Any) -> Any:
    """``tree`` where ``layout`` puts it (across processes, as ``_put`` moves values)."""
    if not self.multiprocess:
      return layout.put(tree)
    return jax.tree.map(self._put, tree, layout.shardings(tree))

  def to_rounds(self, tree: Any) -> Any:
    """``tree`` replicated on the workers × data mesh (θ for the round's start states)."""
    self.require_round_mesh()
    if self.layout is not None:  # θ's specs, replicated over ``workers``
      return self._put_layout(tree, self._rounds)
    return self._put(tree, NamedSharding(self._round_mesh, P()))

  def to_host(self, x: Any) -> np.ndarray:
    if self.multiprocess and not x.is_fully_addressable:
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)

  def agree(self, value: float) -> float:
    if not self.multiprocess:
      return value
    return float(multihost_utils.broadcast_one_to_all(np.float32(value)))

  # Each runs the local computation on inputs placed on the worker's (or all workers') devices.

  def run_worker(self, worker, previous, start, batches, key, carry=False):
    if self.layout is not None:
      put = self._workers[worker].put
      return simulated.compute_worker(
          self._inners[worker], put(previous), put(start), put(batches), put(key), carry)
    replicated = self._replicated[worker]
    return simulated.compute_worker(
        self.inner, self._put(previous, replicated), self._put(start, replicated),
        self._put(batches, self._split[worker]), self._put(key, replicated), carry)

  def transmit(self, uplink, fragment, delta, state):
    """Δ leaves the worker's devices as it is, or compressed there (its compressor state stays
    on them) and decompressed on the server: only the compressor's payload crosses."""
    if uplink.compressor is None:
      return self.to_server(delta), state
    on_worker = jax.tree.leaves(delta)[0].sharding
    if any(not isinstance(x, jax.Array) or x.sharding.device_set != on_worker.device_set
           for x in jax.tree.leaves(state)):  # a first state, or one restored elsewhere
      state = (jax.device_put(state, on_worker) if self.layout is None  # replicated there
               else jax.device_get(state))  # placed with Δ by the next program
    message, state = uplink.send(delta, state)
    if self.layout is not None:  # the payload as a whole on θ's mesh, Δ back in θ's layout
      received = uplink.receive(jax.device_put(message, NamedSharding(self.layout.mesh, P())),
                                fragment)
      return self.to_server(received), state
    return uplink.receive(self.to_server(message), fragment), state

  def run_round(self, states, batches, keys, anchor):
    self.require_round_mesh()
    if self.layout is not None:
      return self.inner.run_many(
          self.to_rounds(states), self._put(batches, self._by_worker),
          self._put(keys, self._by_worker), None if anchor is None else self.to_rounds(anchor))
    by_worker = NamedSharding(self._round_mesh, P("workers"))
    return self.inner.run_many(
        self._put(states, by_worker),
        self._put(batches, NamedSharding(self._round_mesh, P("workers", None, "data"))),
        self._put(keys, by_worker),
        None if anchor is None else self.to_rounds(anchor))

  def run_ddp(self, state, batches, key):
    if self.layout is not None:  # on the round mesh, θ's specs, the batch split over workers
      state, metrics = self.inner.run_jit(
          self.to_rounds(state), self._put(batches, self._ddp_batches), self.to_rounds(key))
      return state, inner_lib.train_loss(metrics)
    replicated, split = self._ddp
    state, metrics = self.inner.run_jit(self._put(state, replicated), self._put(batches, split),
                                        self._put(key, replicated))
    return state, inner_lib.train_loss(metrics)

  def round_delta(self, params: Any, ends: Any, accepted: np.ndarray) -> Any:
    return self.to_server(
        self._round_delta(self.to_rounds(params), ends, self.to_rounds(accepted)))

  def compressed_round_delta(self, uplink, params, ends, accepted, states):
    """Each worker sends on its own group (the round mesh's ``workers``), where its compressor
    state stays; only the messages cross, to every worker (``Uplink.round_delta``)."""
    self.require_round_mesh()
    states = self._put(states, NamedSharding(self._round_mesh, P("workers")))
    delta, states = uplink.round_delta(self.to_rounds(params), ends, self.to_rounds(accepted),
                                       states, mesh=self._round_mesh)
    return self.to_server(delta), states


def device_arrivals(clock: clocks.RealClock, executor: DeviceExecutor,
                    emit: Callable[[dict], None]) -> "DeviceArrivals":
  """The queue of asynchronous results in flight, taken as the devices finish them."""
  del emit
  return DeviceArrivals(clock.now, executor.groups.slowdown, clock.transit)


class DeviceArrivals:
  """Asynchronous results in flight on real devices, taken in the order they finish.

  ``push`` starts a task that waits, in a thread, for the worker's Δ to be
  computed (so the event loop never blocks on a device), then for its
  slow-down; ``pop`` returns the earliest finished worker (and, with a grace
  window, every other worker that finished within it).

  Args:
    clock: the run's real clock (seconds since the run began).
    slowdown: per-worker factors ≥ 1.
    transit: worker -> the link seconds of its dispatch just made (``RealClock.transit``),
      which its arrival waits after its work is done.
  """

  def __init__(self, clock: Callable[[], float], slowdown: Sequence[float],
               transit: Callable[[int], float] = lambda worker: 0.0):
    self._clock = clock
    self._slowdown = slowdown
    self._transit = transit
    self._tasks: dict[int, asyncio.Task] = {}
    self._work: dict[int, asyncio.Task] = {}  # each worker's wait for its work (in _tasks)
    self._threads = concurrent.futures.ThreadPoolExecutor(max(1, len(slowdown)),
                                                          thread_name_prefix="heloco-arrivals")

  def __len__(self) -> int:
    return len(self._tasks)

  async def _ready(self, worker: int, job: Any) -> None:
    """Returns once ``job``'s Δ is computed (in a thread: the event loop never blocks)."""
    del worker
    await asyncio.get_running_loop().run_in_executor(self._threads, jax.block_until_ready,
                                                     job.delta)

  async def _finish(self, worker: int, job: Any, dispatched: float, transit: float) -> float:
    await self._ready(worker, job)
    compute = time.perf_counter() - dispatched
    if self._slowdown[worker] > 1.0:
      await asyncio.sleep((self._slowdown[worker] - 1.0) * compute)
    if transit > 0:  # the link: its download and upload (docs/DESIGN.md, "Runtimes")
      await asyncio.sleep(transit)
    return self._clock()

  async def _until(self, work: Optional[asyncio.Future], at: float) -> float:
    """``work``'s arrival time, or ``at`` if it has not arrived by then (``work`` None: a
    membership event at ``at``)."""
    if work is None:
      await asyncio.sleep(max(0.0, at - self._clock()))
      return at
    if math.isinf(at):
      return await work
    done, _ = await asyncio.wait([work], timeout=max(0.0, at - self._clock()))
    if done:
      return work.result()
    work.cancel()  # its worker left first: what it computes is dropped
    return at

  def heads(self, n: int) -> list[int]:
    del n
    return []  # work starts at dispatch: nothing to launch ahead

  def push(self, worker: int, job: Any, leaves: float = math.inf) -> None:
    """Waits for ``job.delta`` (a ``state.Job``) of ``worker``, until ``leaves`` at the most
    (``base.Arrivals.push``); a membership event waits until ``job.finish``."""
    if job.delta is None and job.work is None:
      self._tasks[worker] = asyncio.ensure_future(self._until(None, job.finish))
    else:
      self._work[worker] = asyncio.ensure_future(
          self._finish(worker, job, time.perf_counter(), self._transit(worker)))
      self._tasks[worker] = asyncio.ensure_future(self._until(self._work[worker], leaves))

  async def pop(self, rule: syncer_lib.GroupRule, events: Optional[base.Events] = None
                ) -> tuple[float, list[int], list[float]]:
    """(real time at which the group is taken, its workers and their arrival times in
    arrival order): the syncer's ``rule`` (quorum, timeout, grace window).

    The time is read when the group is taken, not when its results were
    ready: rows emitted while waiting (Ray's ``redispatched``) are then never
    later in time than the arrival rows logged after them. A membership event
    (``events``) never joins a group: one due first is returned alone, one that
    comes due while a group waits is handled then (as ``SimulatedArrivals.pop``).
    """
    def is_event(worker: int) -> bool:
      return events is not None and events.is_event(worker)

    await asyncio.wait(self._tasks.values(), return_when=asyncio.FIRST_COMPLETED)
    due = sorted((t.result(), w) for w, t in self._tasks.items() if t.done() and is_event(w))
    if due:
      at, worker = due[0]
      del self._tasks[worker]
      return at, [worker], [at]

    def arrived() -> list[tuple[float, int]]:
      for at, worker in sorted((t.result(), w) for w, t in self._tasks.items()
                               if t.done() and is_event(w)):
        del self._tasks[worker]
        events.handle(worker, at)  # pyright: ignore  (is_event: events is set)
      return sorted((t.result(), w) for w, t in self._tasks.items() if t.done())

    def expected() -> int:  # the entries that may still bring work
      return sum(1 for w in self._tasks if not is_event(w) or events.brings_work(w))  # pyright: ignore

    first = arrived()[0][0]

    async def wait_until(deadline: float, all_of_them: bool = False) -> None:
      pending = [t for t in self._tasks.values() if not t.done()]
      if pending and deadline > self._clock():
        await asyncio.wait(pending, timeout=None if math.isinf(deadline)
                           else deadline - self._clock(),
                           return_when=asyncio.ALL_COMPLETED if all_of_them
                           else asyncio.FIRST_COMPLETED)

    while (len(arrived()) < rule.quorum and len(arrived()) < expected()
           and self._clock() < first + rule.timeout):
      await wait_until(first + rule.timeout)
    done = arrived()[:max(1, rule.quorum)]
    closed = rule.close(len(done), first, done[-1][0], len(arrived()) < expected())
    closed = min(closed, self._clock())
    if rule.window > 0:
      await wait_until(closed + rule.window, all_of_them=True)
      done += [(at, w) for at, w in arrived()[len(done):] if rule.in_grace(closed, at)]
    for _, worker in done:
      del self._tasks[worker]
    return self._clock(), [w for _, w in done], [at for at, _ in done]

  def close(self) -> None:
    """Drops whatever is still in flight (a budget ended). Waits for the threads that wait on
    it: one finishing after the event loop closed would report to a closed loop."""
    for task in [*self._tasks.values(), *self._work.values()]:
      task.cancel()
    self._tasks.clear()
    self._work.clear()
    self._threads.shutdown(wait=True, cancel_futures=True)
