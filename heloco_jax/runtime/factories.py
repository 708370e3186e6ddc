"""``runtime=`` values for ``hj.make_engine``: each composes an executor, a clock and a queue.

::

  hj.simulate(..., runtime=hj.simulated_runtime())          # the default
  hj.simulate(..., runtime=hj.devices_runtime(batch_size=8))  # real devices, real time
  hj.simulate(..., runtime=hj.ray_runtime(num_cpus=4))        # Ray actors, real time

A factory is called once by ``make_engine`` with the workers' inner loop and
the run's spec and returns a ``base.Runtime``. Its ``simulated_clock`` says,
before anything starts, whether the run's time is simulated (and so whether
bit-exact replay is the default, ``deterministic=None``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Union

import jax

from heloco_jax.runtime import base, clocks, simulated
from heloco_jax.runtime.state import RunSpec
from heloco_jax.training import inner as inner_lib
from heloco_jax.training import server as server_lib


@dataclasses.dataclass(frozen=True)
class RuntimeFactory:
  """Builds a run's ``base.Runtime`` from its inner loop and spec.

  Attributes:
    build: ``(inner loop, spec) -> Runtime``.
    simulated_clock: whether the runtime's time is simulated.
    synchronies: the method synchronies it can run (``base.SYNCHRONIES``).
    multiprocess: it can span processes (``jax.distributed``).
    worker_devices: ``K -> the devices one worker's θ spans`` (what a model
      sharded for this runtime is split over: ``sharding.put_fsdp``).
    outer_layout: how the server holds θ and the outer state (``simulated_runtime``'s).
  """
  build: Callable[[inner_lib.InnerLoop, RunSpec], base.Runtime]
  simulated_clock: bool
  synchronies: frozenset[str] = base.SYNCHRONIES
  multiprocess: bool = False
  worker_devices: Callable[[int], Sequence[Any]] = lambda k: jax.local_devices()
  outer_layout: server_lib.OuterLayout = "auto"

  def __post_init__(self):
    server_lib.packs_outer(self.outer_layout, rule=False, user_rule=False, sharded=False)

  def __call__(self, inner: inner_lib.InnerLoop, spec: RunSpec) -> base.Runtime:
    return self.build(inner, spec)


def simulated_runtime(devices: Optional[Sequence[Any]] = None,
                      worker_batching: simulated.WorkerBatching = "auto",
                      outer_layout: server_lib.OuterLayout = "auto",
                      inner_loop: inner_lib.Loop = "auto",
                      pending_memory: simulated.PendingMemory = "device") -> RuntimeFactory:
  """Simulated heterogeneous workers on this process's devices, on the simulated clock.

  Deterministic: a run replays bit for bit (docs/DESIGN.md, "Determinism").

  Args:
    devices: where workers compute (default ``jax.local_devices()``; the
      first holds θ); several let in-flight workers compute concurrently.
    worker_batching: how the K workers of a synchronous round compute: "vmap" (one
      program over a stacked worker axis), "sequential" (one worker's program, K times)
      or "auto" (per backend, from ``python -m benchmarks.worker_batching``:
      ``simulated.AUTO_BATCHING``). Either compiles one inner loop whatever K.
    outer_layout: how the server holds θ and the outer state: "tree" (as given), "packed"
      (one buffer per dtype, docs/ALGORITHMS.md "Packed outer state": within float32
      rounding of the tree, a few kernels per outer step instead of a few per leaf) or
      "auto" (packed for a registry rule on an accelerator with θ unsharded, else the
      tree: ``heloco_jax.training.server.packs_outer``).
    inner_loop: how a worker's H inner steps run: "scan" (one compiled loop), "steps" (one
      compiled step per Python iteration) or "auto" (steps for a loss with a convolution on
      CPU, where XLA runs it several times slower inside a loop; else the scan: docs/DESIGN.md,
      "The inner loop"). The two agree to float reassociation; "scan" gives the bits of
      releases before "auto".
    pending_memory: where an asynchronous worker's start point waits until its steps run:
      "device" or "pinned_host" (host memory, one copy per outer update, moved back when the
      worker computes: the accelerator then holds only the workers computing; the same bits;
      docs/DESIGN.md, "Memory per worker").
  """
  simulated.check_batching(worker_batching)
  simulated.check_pending_memory(pending_memory)
  inner_lib.check_loop(inner_loop, "inner_loop")

  def build(inner: inner_lib.InnerLoop, spec: RunSpec) -> base.Runtime:
    del spec
    inner = inner.with_loop(inner_loop)
    return base.Runtime(simulated.LocalExecutor(inner, devices, worker_batching, pending_memory),
                        simulated.SimulatedClock, simulated.simulated_arrivals)
  return RuntimeFactory(build, simulated_clock=True,
                        worker_devices=lambda k: list(devices or jax.local_devices()),
                        outer_layout=outer_layout)


def devices_runtime(batch_size: int, group_sizes: Union[str, Sequence[int]] = "",
                    server: int = 0, slowdown: Union[str, Sequence[float]] = "",
                    outer_layout: server_lib.OuterLayout = "auto") -> RuntimeFactory:
  """Each worker on its own group of ``jax.devices()``, on the real clock.

  Args:
    batch_size: the leading size of every batch (split over a group's devices).
    group_sizes: "" (the devices split evenly) or K group sizes.
    server: index into ``jax.devices()`` of the device holding θ and the outer step.
    slowdown: "" or K factors >= 1 (worker i's result arrives after f_i × its compute).
    outer_layout: how the server holds θ and the outer state (``simulated_runtime``'s).
  """
  def build(inner: inner_lib.InnerLoop, spec: RunSpec) -> base.Runtime:
    from heloco_jax.runtime import devices  # pylint: disable=g-import-not-at-top
    groups = devices.group_devices(spec.num_workers, batch_size, group_sizes, server, slowdown,
                                   synchronous=spec.method.synchrony != "async")
    return base.Runtime(devices.DeviceExecutor(inner, groups), clocks.RealClock,
                        devices.device_arrivals)

  def first_group(k: int) -> Sequence[Any]:  # every group takes θ's mesh's shape
    from heloco_jax.runtime import devices  # pylint: disable=g-import-not-at-top
    return devices.group_devices(k, batch_size, group_sizes, server, slowdown).groups[0]
  return RuntimeFactory(build, simulated_clock=False, multiprocess=True,
                        worker_devices=first_group, outer_layout=outer_layout)


def ray_runtime(outer_layout: server_lib.OuterLayout = "auto", **options: Any
                ) -> RuntimeFactory:
  """A parameter-server actor and one actor per worker, on the real clock.

  Args:
    outer_layout: how the server actor holds θ and the outer state (``simulated_runtime``'s;
      "auto" reads this process's default backend).
    **options: the fields of ``heloco_jax.runtime.ray.RayOptions`` (address,
      num_cpus, cpus_per_worker, gpus_per_worker, server_gpus, slowdown, ...).
  """
  from heloco_jax.runtime import ray  # pylint: disable=g-import-not-at-top
  ray_options = ray.RayOptions(**options)

  def build(inner: inner_lib.InnerLoop, spec: RunSpec) -> base.Runtime:
    return base.Runtime(ray.RayExecutor(inner, spec.num_workers, ray_options), clocks.RealClock,
                        ray.ray_arrivals)
  # A sharded θ's mesh: this process's devices; each actor rebuilds it on as many of its own.
  return RuntimeFactory(build, simulated_clock=False, synchronies=ray.RayExecutor.synchronies,
                        outer_layout=outer_layout)
