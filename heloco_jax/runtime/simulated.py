"""The simulated runtime: this process's devices, simulated seconds and their arrival queue.

``LocalExecutor`` computes on this process's devices; work dispatched to a
worker is computed lazily by the engine (docs/DESIGN.md, "Runtimes"). Its
computation (``compute_worker``, ``round_delta``) and the one-process transfers
(``OneProcess``) are the ones the devices and Ray runtimes run too.
``SimulatedClock`` times each dispatch in simulated seconds (``StepClock``: the
workers' steps, with optional jitter; ALGORITHMS.md, "Time and cost model"), and
``SimulatedArrivals`` hands out the jobs in the order of their simulated finish
times, ties broken by worker index, so a run reproduces bit for bit.
"""

from __future__ import annotations

import functools
import heapq
import math
from typing import Any, Callable, Literal, Optional, get_args

import jax
import jax.numpy as jnp
import numpy as np

from heloco_jax.training import aggregate as aggregate_lib
from heloco_jax.comm import downlink
from heloco_jax.comm import syncer as syncer_lib
from heloco_jax.runtime import base
from heloco_jax.training import inner as inner_lib
from heloco_jax.training import server as server_lib


class SimulatedArrivals:
  """Jobs in flight on the simulated clock, popped by (finish time, worker).

  (finish, worker) pairs are unique, so a heap rebuilt from restored jobs pops
  in the same order as the one it replaces.
  """

  def __init__(self):
    self._heap: list[tuple[float, int]] = []

  def __len__(self) -> int:
    return len(self._heap)

  def push(self, worker: int, job: Any, leaves: float = math.inf) -> None:
    del leaves  # a dispatch its worker leaves before is lost at dispatch (loops.run_async)
    heapq.heappush(self._heap, (job.finish, worker))

  def heads(self, n: int) -> list[int]:
    """The workers of the ``n`` jobs that arrive next, in arrival order."""
    return [worker for _, worker in heapq.nsmallest(n, self._heap)]

  async def pop(self, rule: syncer_lib.GroupRule, events: Optional[base.Events] = None
                ) -> tuple[float, list[int], list[float]]:
    """(when the group closes, its workers and their arrival times in arrival order): the
    syncer's ``rule`` (quorum, timeout, grace window; ALGORITHMS.md, "Syncer policies").

    Membership events (``events``) in the queue never join a group: one at the head is
    returned alone; one that comes while a group waits for its quorum is handled at its time
    (the work it dispatches may join the group), and one within a grace window ends it.
    """
    first, worker = heapq.heappop(self._heap)
    group, times, handled = [worker], [first], [first]
    if (events is not None and events.is_event(worker)) or (
        rule.quorum == 1 and rule.window == 0):  # alone (the default: one update per arrival)
      return first, group, times

    def event_next() -> bool:
      return events is not None and events.is_event(self._heap[0][1])

    while self._heap and rule.wants_more(len(group), first, self._heap[0][0]):
      at, worker = heapq.heappop(self._heap)
      if events is not None and events.is_event(worker):
        events.handle(worker, at)
        handled.append(at)
      else:
        group.append(worker)
        times.append(at)
    more = any(events is None or events.brings_work(w) for _, w in self._heap)
    closed = max(rule.close(len(group), first, times[-1], more), handled[-1])
    # A grace window of 0 (default) is off: simultaneous arrivals stay separate updates.
    while self._heap and not event_next() and rule.in_grace(closed, self._heap[0][0]):
      at, worker = heapq.heappop(self._heap)
      group.append(worker)
      times.append(at)
    return max(closed, times[-1]), group, times

  def close(self) -> None:
    self._heap.clear()


def round_delta(params: Any, ends: Any, accepted: jax.Array) -> Any:
  """A round's Δ = θ − mean of the accepted workers' end parameters (stacked on axis 0;
  ``hj.aggregate.accepted_mean``)."""
  return jax.tree.map(jnp.subtract, params, aggregate_lib.accepted_mean(ends, accepted))


@jax.jit
def _stack(trees: Any) -> Any:
  """A list of equal trees stacked on a new leading axis (one compiled program)."""
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


@jax.jit
def _subtract(start: Any, end: Any) -> Any:
  """Δ = start − end, one compiled program for the whole tree."""
  return jax.tree.map(jnp.subtract, start, end)


def compute_worker(inner: inner_lib.InnerLoop, previous: Optional[inner_lib.InnerState],
                   start: Any, batches: Any, key: jax.Array, carry: bool = False
                   ) -> tuple[inner_lib.InnerState, Any, jax.Array]:
  """H inner steps from ``start`` where the inputs live: (end state, Δ = start − end, mean
  training loss). ``previous`` is the worker's inner state after its last dispatch (None at
  first): the step count and, unless reset, the optimizer state carry over. ``carry``: the
  end state cut to what a next dispatch from θ reads (``InnerLoop.carry``; an asynchronous
  dispatch's, docs/DESIGN.md "Memory per worker")."""
  state, metrics = inner.run_jit(inner.start_jit(start, previous), batches, key)
  delta = _subtract(start, state.params)
  return inner.carry_jit(state) if carry else state, delta, inner_lib.train_loss(metrics)


WorkerBatching = Literal["auto", "vmap", "sequential"]
# "auto" per backend (docs/DESIGN.md, "Worker batching": ``python -m benchmarks.worker_batching``
# on CPU, vmapped ÷ sequential at K = 2, 5, 16: a CNN 1.23, 1.48, 3.79; TinyGPT 0.92, 0.93,
# 1.51). Accelerators keep vmap: one program over the workers, not measured here.
AUTO_BATCHING = {"cpu": "sequential", "gpu": "vmap", "tpu": "vmap"}


class OneProcess:
  """The transfers of an executor whose arrays all live in the engine's one process.

  θ needs no placing for the server or for a round, values are read as they
  are, and every process agrees with itself.
  """

  def to_server(self, tree: Any) -> Any:
    return tree

  def to_rounds(self, tree: Any) -> Any:
    return tree

  def to_host(self, x: Any) -> np.ndarray:
    return np.asarray(x)

  def agree(self, value: float) -> float:
    return value

  def fetch(self, tree: Any, what: str) -> Any:
    del what
    return tree

  def make_downlink(self, compressor: Any, params: Any, server: Any,
                    fragments: Any) -> downlink.Downlink:
    del server  # the engine holds every x̂ where θ is
    return downlink.Downlink(compressor, params, fragments)

  def run_fragment(self, worker: int, previous: Any, steps: Any, batches: Any,
                   key: jax.Array) -> tuple[Any, Any, Any]:
    run_worker = self.run_worker  # pyright: ignore  (the executor's: this is a mixin)
    return steps.run(run_worker, worker, previous, batches, key)

  def transmit(self, uplink: Any, fragment: int, delta: Any, state: Any) -> tuple[Any, Any]:
    del fragment  # Δ is where θ is: compressed and received in one program
    return (delta, state) if uplink.compressor is None else uplink.transmit(delta, state)

  def compressed_round_delta(self, uplink: Any, params: Any, ends: Any, accepted: np.ndarray,
                             states: Any) -> tuple[Any, Any]:
    return uplink.round_delta(params, ends, accepted, states)


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


class SimulatedClock:
  """Deterministic simulated seconds (docs/ALGORITHMS.md, "Time and cost model").

  A dispatch takes θ's download + compute + Δ's upload (its compressed bytes);
  a round its slowest worker plus one ring all-reduce of the (compressed) Δ;
  a DDP step the slowest worker's step plus one all-reduce of the gradient,
  less what ``comm.ddp_overlap`` hides. Work is computed lazily (``eager`` False).

  With fragments (ALGORITHMS.md, "Fragments") a worker sends a fragment every
  H/P steps and, with overlap τ, keeps computing while it is in flight
  (``fragment_arrival``); a round's all-reduce hides behind τ steps.

  Attributes:
    download, upload: seconds of a dispatch's θ download and Δ upload.
    allreduce: seconds of a round's all-reduce.
    downloads, uploads, allreduces: the same per fragment.
  """

  eager = False
  simulated = True

  def __init__(self, settings: base.ClockSettings, executor: base.Executor):
    del executor
    self.steps = StepClock(settings.seconds_per_step, settings.jitter, settings.seed)
    self.num_workers = len(settings.seconds_per_step)
    self.link = link = base.link_of(settings)  # the cost model both clocks charge
    self.uploads, self.downloads, self.allreduces = link.uploads, link.downloads, link.allreduces
    self.download, self.upload, self.allreduce = link.download, link.upload, link.allreduce
    self.overlap_steps = settings.overlap_steps
    self._slowest = float(np.max(settings.seconds_per_step))
    self.comm = link.comm

  def start(self, elapsed: float) -> None:
    del elapsed

  def finish(self, worker: int, steps: int, now: float,
             download_bytes: Optional[int] = None) -> float:
    """When a dispatch's Δ reaches the server: θ's download (or one of ``download_bytes``),
    its steps and its upload."""
    down = self.download if download_bytes is None else self.comm.message_seconds(download_bytes)
    return now + down + self.steps.duration(worker, steps) + self.upload

  def round_seconds(self, real_steps: np.ndarray, start: float) -> float:
    del start
    return (max(self.steps.duration(i, int(real_steps[i])) for i in range(self.num_workers))
            + self.allreduce)

  def fragment_arrival(self, worker: int, steps: int, now: float, received: Optional[int],
                       sent: int) -> float:
    """When a worker's next fragment reaches the server (ALGORITHMS.md, "Fragments").

    The worker's last fragment arrived at ``now``; it then receives fragment
    ``received`` (None: all of θ, a first dispatch), takes ``steps`` inner
    steps (the first τ of them while the download is in flight, from when it
    sent its last fragment, ``now`` − that fragment's upload) and sends
    fragment ``sent``.
    """
    down = self.download if received is None else self.downloads[received]
    tau = min(self.overlap_steps, steps) if received is not None else 0
    if tau == 0:
      return now + down + self.steps.duration(worker, steps) + self.uploads[sent]
    sent_at = now - self.uploads[received]  # it sent `received`'s Δ then, and went on
    resume = max(sent_at + self.steps.duration(worker, tau), now + down)
    return resume + self.steps.duration(worker, steps - tau) + self.uploads[sent]

  def fragment_wait(self, worker: int, received: Optional[int], sent: int) -> float:
    """The seconds a worker waits on the network for one fragment sync (network_seconds):
    without overlap θ's or the fragment's download and the upload of what it sends; with
    overlap the round trip of the fragment less τ steps at the worker's nominal speed."""
    if received is None or self.overlap_steps == 0:
      down = self.download if received is None else self.downloads[received]
      return down + self.uploads[sent]
    return max(0.0, self.uploads[received] + self.downloads[received]
               - self.overlap_steps * float(self.steps.seconds[worker]))

  def exposed_allreduce(self, fragment: int) -> float:
    """The seconds of fragment ``fragment``'s all-reduce that the τ steps of the next round
    (at the slowest worker's speed) do not hide: all of it without overlap."""
    return max(0.0, self.allreduces[fragment] - self.overlap_steps * self._slowest)

  def fragment_round_seconds(self, steps: int, fragment: int, start: float,
                             present: Optional[np.ndarray] = None) -> float:
    """A round of ``steps`` steps of the ``present`` workers (default all) that ends in
    fragment ``fragment``'s exposed all-reduce."""
    del start  # the round's seconds are simulated
    compute = max(self.steps.duration(i, steps if present is None or present[i] else 0)
                  for i in range(self.num_workers))
    return compute + self.exposed_allreduce(fragment)

  def plan_ddp(self, chunk: int, start: float, limit: float,
               workers: Optional[np.ndarray] = None) -> tuple[int, Optional[list]]:
    """(steps to run, their (seconds, exposed all-reduce seconds)): only the steps that end
    within ``limit`` (0 = none); of the ``workers`` present (booleans; default all)."""
    present = [i for i in range(self.num_workers) if workers is None or workers[i]]
    allreduce = self.link.ddp_allreduce(len(present))
    computes = [max(self.steps.duration(i, 1) for i in present) for _ in range(chunk)]
    seconds = [self.comm.ddp_step_seconds(c, allreduce) for c in computes]
    if limit > 0:
      chunk = int(np.sum(start + np.cumsum(seconds) <= limit))
    return chunk, [(t, t - c) for t, c in zip(seconds[:chunk], computes[:chunk])]

  def ddp_seconds(self, planned: Optional[list], start: float, params: Any) -> float:
    del start, params
    return sum(t for t, _ in planned)

  def ddp_exposed(self, planned: Optional[list], step: int) -> Optional[float]:
    """Step ``step``'s all-reduce seconds that its compute does not hide."""
    return None if planned is None else planned[step][1]

  async def wait_until(self, t: float) -> None:
    del t  # simulated seconds pass when the engine sets its time

  def get_state(self) -> Any:
    return self.steps.get_state()

  def set_state(self, state: Any) -> None:
    self.steps.set_state(state)


PendingMemory = Literal["device", "pinned_host"]
PENDING_MEMORIES: tuple[str, ...] = get_args(PendingMemory)


def _in_memory(tree: Any, kind: str) -> Any:
  """``tree`` moved to memory ``kind`` of the devices it is on (``jax.device_put``)."""
  return jax.device_put(tree, jax.tree.map(lambda x: x.sharding.with_memory_kind(kind), tree))


def check_pending_memory(kind: Any) -> None:
  if kind not in PENDING_MEMORIES:
    raise ValueError(f"pending_memory={kind!r} is not allowed; allowed: one of "
                     f"{list(PENDING_MEMORIES)}")


def check_batching(batching: Any) -> None:
  if batching not in ("auto", "vmap", "sequential"):
    raise ValueError(f"worker_batching={batching!r} is not allowed; allowed: 'auto', 'vmap' "
                     "or 'sequential'")


class LocalExecutor(OneProcess):
  """Computation on this process's devices (the simulated runtime's executor).

  θ, the outer step and synchronous rounds live on the first device. An
  asynchronous worker's inner steps run on ``devices[worker % D]``, so with
  several devices (e.g. host CPU devices, ``--xla_force_host_platform_device_count``)
  the in-flight workers' steps run concurrently: JAX dispatches them
  asynchronously and the engine launches the next D arrivals' work ahead.
  Every device runs the same compiled program, so the numbers do not depend
  on where a worker ran; the clock alone decides the order of arrivals.
  When θ is sharded (``inner.layout``), every worker runs on θ's mesh, one
  after another, and θ and the outer state keep θ's layout
  (docs/DESIGN.md, "Scaling out").

  Args:
    inner: the workers' compiled inner loop.
    devices: where workers compute (default: ``jax.local_devices()``; the
      first holds θ).
    worker_batching: a round's K workers as one vmapped program or one after another
      (``simulated_runtime``).
    pending_memory: where a dispatched worker's start waits until its steps run: "device"
      or "pinned_host" (host memory: device memory then holds only the workers computing;
      docs/DESIGN.md, "Memory per worker").
  """

  synchronies = base.SYNCHRONIES
  compresses = compresses_downloads = True

  def __init__(self, inner: inner_lib.InnerLoop, devices: Optional[list[Any]] = None,
               worker_batching: WorkerBatching = "auto", pending_memory: PendingMemory = "device"):
    check_batching(worker_batching)
    check_pending_memory(pending_memory)
    self.pending_memory = pending_memory
    self.inner = inner
    self.layout = inner.layout
    self.devices = list(devices) if devices is not None else jax.local_devices()
    if self.layout is not None:  # one mesh: θ's
      self.devices = self.devices[:1]
    self.concurrency = len(self.devices)  # one worker's steps per device at once
    self.batching = (AUTO_BATCHING.get(self.devices[0].platform, "vmap")
                     if worker_batching == "auto" else worker_batching)
    constrain = self.layout.constrain if self.layout is not None else lambda tree: tree
    self._round_delta = jax.jit(lambda *args: constrain(round_delta(*args)))

  def make_server(self, outer_tx: Any, params: Any, **options: Any) -> server_lib.OuterServer:
    if self.pending_memory != "device":  # its dispatch points wait there
      options["park"] = functools.partial(_in_memory, kind=self.pending_memory)
    return server_lib.OuterServer(outer_tx, params, place=self.to_server, layout=self.layout,
                                  **options)

  def to_server(self, tree: Any) -> Any:
    if self.layout is not None:
      return self.layout.put(tree)
    # θ's device: a worker's results come back from its own (``run_worker``)
    return tree if len(self.devices) == 1 else jax.device_put(tree, self.devices[0])

  def to_rounds(self, tree: Any) -> Any:
    return self.to_server(tree)

  def describe(self) -> str:
    if self.layout is not None:
      return f"simulated workers (θ sharded over {dict(self.layout.mesh.shape)})"
    parked = "" if self.pending_memory == "device" else f", pending starts in {self.pending_memory}"
    return f"simulated workers (worker_batching={self.batching}{parked})"  # "auto" resolved

  def round_delta(self, params: Any, ends: Any, accepted: np.ndarray) -> Any:
    return self._round_delta(params, ends, accepted)

  def close(self) -> None:
    pass

  def fresh_moments(self, state: inner_lib.InnerState) -> inner_lib.InnerState:
    return self.inner.fresh_moments(state)

  def run_worker(self, worker: int, previous: Optional[inner_lib.InnerState], start: Any,
                 batches: Any, key: jax.Array, carry: bool = False
                 ) -> tuple[inner_lib.InnerState, Any, jax.Array]:
    """Worker ``worker``'s H steps from ``start`` on its device (``compute_worker``)."""
    if self.pending_memory != "device":  # a parked start, back in device memory
      start = _in_memory(start, "device")
    device = self.devices[worker % len(self.devices)]
    if device != self.devices[0]:  # inputs follow the worker (Δ goes back: ``transmit``)
      start, previous, batches, key = jax.device_put((start, previous, batches, key), device)
    return compute_worker(self.inner, previous, start, batches, key, carry)

  def transmit(self, uplink, fragment, delta, state):
    """Δ back on θ's device, then compressed and received there in one program."""
    if self.layout is None and len(self.devices) > 1:
      delta = jax.device_put(delta, self.devices[0])
    return super().transmit(uplink, fragment, delta, state)

  def run_round(self, states, batches, keys, anchor):
    if self.batching == "vmap":
      return self.inner.run_many(states, batches, keys, anchor)
    k = len(keys)
    ran = [self.inner.run_jit(jax.tree.map(lambda x, i=i: x[i], states),
                              jax.tree.map(lambda x, i=i: x[i], batches), keys[i], anchor)
           for i in range(k)]
    return _stack(ran)

  def run_ddp(self, state, batches, key):
    state, metrics = self.inner.run_jit(state, batches, key)
    return state, inner_lib.train_loss(metrics)


def simulated_arrivals(clock: base.Clock, executor: base.Executor,
                       emit: Callable[[dict], None]) -> SimulatedArrivals:
  """The arrival queue of the simulated clock (``base.ArrivalsFactory``)."""
  del clock, executor, emit
  return SimulatedArrivals()
