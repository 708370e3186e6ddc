"""The engine: any method of the registry, any model, on any runtime.

A run is (docs/DESIGN.md, "The idea in one picture"): a ``Method`` of the
registry (synchrony, outer rule, dispatch rule, inner variant), a user's
problem (an ``InnerLoop`` over ``loss_fn`` and ``inner_tx``, initial params,
K per-worker data streams, an optional ``eval_fn``), a ``RunSpec`` (schedule,
budgets, cadence) and a ``Runtime`` with its clock. ``Engine.run`` is an
asyncio coroutine that yields to the event loop after every event.

The loops, one per synchrony of the registry, are in ``runtime.loops``; the
run's spec, budget, state, data streams and rows in ``runtime.state``.

Budgets count *units*: ``units_per_step`` per inner step whose result
reached the server (1: local steps, the authors' budget; the CLI counts
tokens), applied or rejected: a rejected pseudo-gradient's compute was spent.
The summary reports the applied and the rejected units apart. PALSGD's
pseudo-sync steps read no data and count none. Work whose arrival would pass
a budget is discarded, with everything still in flight.

Faults (``heloco_jax.rejection``): a non-finite pseudo-gradient is
rejected before the outer rule, with a ``{"event": "rejected"}`` row; the
worker restarts with a fresh optimizer state. After ``RunSpec.rejection_limit``
rejections in a row (default K, at least 2), at the end of a run in which
every arrival was rejected, or when an evaluation is not finite, the run stops
with a ``DivergenceError`` naming the workers and the cause.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Callable, Iterable, Optional, Sequence

import jax
import numpy as np

from heloco_jax import rejection
from heloco_jax.runtime import base, loops
from heloco_jax.runtime.state import Recorder, RunSpec, RunState, WorkerStream

Row = dict[str, Any]


class Stopped(Exception):
  """A requested stop (``Engine.request_stop``) ended the run at a loop boundary.

  Attributes:
    reason: what asked for it (e.g. "SIGTERM").
    checkpointed: whether a checkpoint of that boundary was written first.
  """

  def __init__(self, reason: str, checkpointed: bool):
    super().__init__(f"stopped by {reason}")
    self.reason, self.checkpointed = reason, checkpointed


class BudgetError(ValueError):
  """The budget ended before any work reached the server."""


def eval_metrics(value: Any) -> dict[str, float]:
  """An ``eval_fn``'s result as ``{"val_loss": ..., ...}`` of Python floats."""
  value = jax.device_get(value)
  if not isinstance(value, dict):
    return {"val_loss": float(value)}
  if "val_loss" not in value:
    raise ValueError(f"eval_fn returned a dict with keys {sorted(value)}; allowed: a scalar "
                     "loss, or a dict holding it as 'val_loss' (and any other scalars)")
  return {key: float(v) for key, v in value.items()}


class Engine:
  """One run of ``spec`` on ``runtime``.

  Args:
    spec: the ``RunSpec``.
    runtime: where work runs (a ``Runtime``: ``SimulatedRuntime``, ``DeviceRuntime``,
      ``RayRuntime``).
    params: the initial θ (any pytree).
    data: K per-worker iterables of batches (pytrees of arrays).
    outer_tx: the outer rule (None for DDP).
    eval_fn: ``params -> loss`` or ``-> {"val_loss": ..., ...}``; None: no evaluations.
    lookahead: dispatch from θ − η·μ·m.
    arrival_weight: ρ(τ), for combining a grace window's arrivals.
  """

  def __init__(self, spec: RunSpec, runtime: base.Runtime, params: Any,
               data: Sequence[Iterable[Any]], outer_tx: Any = None,
               eval_fn: Optional[Callable[[Any], Any]] = None, lookahead: bool = False,
               arrival_weight: Optional[Callable[[int], float]] = None):
    if len(data) != spec.num_workers:
      raise ValueError(f"data holds {len(data)} worker streams; allowed: one per worker "
                       f"(num_workers={spec.num_workers})")
    if spec.method.outer is not None and outer_tx is None:
      raise ValueError(f"method={spec.method.name!r} needs an outer rule (outer_tx)")
    self.spec = spec
    self.method = spec.method
    self.runtime = runtime
    self.inner = runtime.inner
    self.num_params = int(sum(np.size(x) for x in jax.tree.leaves(params)))
    self.model_bytes = sum(int(np.size(x)) * np.dtype(x.dtype).itemsize  # no copy of θ
                           for x in jax.tree.leaves(params))
    self.streams = [WorkerStream(source) for source in data]
    self.eval_fn = eval_fn
    self.server = runtime.make_server(outer_tx, params, lookahead=lookahead,
                                      arrival_weight=arrival_weight)
    self.clock = runtime.make_clock(np.asarray(spec.seconds_per_step, float), spec.jitter,
                                    spec.seed, spec.comm, self.model_bytes)
    self.recorder = Recorder(spec.metrics_fetch_every)
    self.key = jax.random.key(spec.seed)
    self.state = RunState(arrivals=[0] * spec.num_workers,
                          next_checkpoint=spec.checkpoint_every)
    self.streak = rejection.RejectionStreak(spec.num_workers, spec.rejection_limit)
    self._on_checkpoint: Optional[Callable[[Engine], None]] = None
    self.stop_requested: Optional[str] = None
    self._wall_start = time.perf_counter()

  # θ and the outer state live on the server (``heloco_jax.server``).

  @property
  def params(self) -> Any:
    return self.server.params

  @params.setter
  def params(self, value: Any) -> None:
    self.server.params = value

  @property
  def outer_state(self) -> Any:
    return self.server.outer_state

  @property
  def rows(self) -> list[Row]:
    return self.recorder.rows

  @property
  def units(self) -> int:
    return self.state.units

  @property
  def version(self) -> int:
    return self.state.version

  @property
  def sim_time(self) -> float:
    return self.state.sim_time

  # ------------------------------------------------------------ checkpoints

  def checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole run state at a loop boundary: (arrays, JSON-serialisable meta)."""
    s = self.state
    for worker in s.jobs:
      self.compute(worker)
    params, outer_state = self.server.get()
    fetch = self.runtime.fetch  # Ray: waits for work still in flight
    arrays = {"params": params, "outer_state": outer_state,
              "key": jax.random.key_data(self.key),
              "workers": fetch(s.workers, "state"),
              "pending": [fetch(s.jobs[w].delta, "delta") for w in sorted(s.jobs)]}
    meta = s.meta()
    for entry, w in zip(meta["jobs"], sorted(s.jobs)):
      loss = fetch(s.jobs[w].train_loss, "train_loss")
      entry.append(None if loss is None else float(loss))
    meta["wall_before"] = s.wall_before + time.perf_counter() - self._wall_start
    meta["clock"] = self.clock.get_state()
    meta["streams"] = [stream.get_state() for stream in self.streams]
    return arrays, meta

  def state_template(self, meta: dict[str, Any]) -> dict[str, Any]:
    """The abstract arrays of a ``checkpoint_state()`` with this ``meta`` (for restoring)."""
    worker = jax.eval_shape(self.inner.start, self.params)
    k = self.spec.num_workers
    stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((k, *x.shape), x.dtype), worker)
    workers = {None: None, "ddp": worker, "rounds": stacked, "async": [worker] * k}[meta["phase"]]
    return {"params": self.params, "outer_state": self.outer_state,
            "key": jax.random.key_data(self.key), "workers": workers,
            "pending": [self.params] * len(meta["jobs"])}

  def load_state(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
    """Continues from a ``checkpoint_state()`` of a run with the same spec."""
    self.server.set(arrays["params"], arrays["outer_state"])
    self.key = jax.random.wrap_key_data(arrays["key"])
    self.state.load(meta, arrays["pending"], arrays["workers"])
    self.streak.set_state(self.state.rejected_in_a_row)
    self.clock.set_state(meta["clock"])
    for stream, position in zip(self.streams, meta["streams"], strict=True):
      stream.set_state(position)

  def request_stop(self, reason: str) -> None:
    """Asks the run to stop at its next loop boundary, after a checkpoint (preemption).

    Safe to call from a signal handler: it only sets a flag. ``run`` then
    raises ``Stopped``; the same run, restored from that checkpoint, ends as
    an uninterrupted one would.
    """
    self.stop_requested = reason

  def maybe_checkpoint(self) -> None:
    """At a loop boundary: the checkpoint hook every ``checkpoint_every`` outer updates,
    and before a requested stop (then raises ``Stopped``)."""
    every, s = self.spec.checkpoint_every, self.state
    due = every > 0 and s.version >= s.next_checkpoint
    if not (due or self.stop_requested):
      return
    if due:
      s.next_checkpoint = (s.version // every + 1) * every
    self.recorder.flush()  # the checkpoint's rows are all written before it
    if self._on_checkpoint is not None:
      s.rejected_in_a_row = self.streak.get_state()
      self._on_checkpoint(self)
    if self.stop_requested:
      raise Stopped(self.stop_requested, checkpointed=self._on_checkpoint is not None)

  # ------------------------------------------------------------------ helpers

  def evaluate(self, force: bool = False) -> None:
    """An eval row when the unit count has passed the next eval point (or forced)."""
    s = self.state
    if self.eval_fn is None or (not force and s.units < s.next_eval):
      return
    every = self.spec.eval_every
    s.next_eval = (s.units // every + 1) * every if every > 0 else math.inf
    metrics = eval_metrics(self.eval_fn(self.params))
    bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
    if bad:
      where = ("before training" if s.version == 0 and s.units == 0
               else f"after {s.version} outer updates")
      raise rejection.DivergenceError(
          f"the evaluation {where} is not finite ({', '.join(f'{k}={v}' for k, v in bad.items())})"
          ": the run diverged" + (", or the model cannot take the data (e.g. a token id outside "
                                  "the vocabulary)" if s.version == 0 else ""))
    row = {"event": "eval", self.spec.unit: s.units, "sim_time": s.sim_time,
           "outer_updates": s.version, **metrics}
    s.last_eval = row
    self.recorder.emit(row)

  def batches(self, worker: int, steps: int) -> Any:
    """Worker ``worker``'s next ``steps`` batches, stacked on a leading axis."""
    return self.streams[worker].next(steps)

  def compute(self, worker: int) -> Any:
    """``worker``'s pending Δ, running its deferred inner steps first if needed."""
    job = self.state.jobs[worker]
    if job.work is not None:
      self.state.workers[worker], job.delta, job.train_loss = job.work()
      job.work = None
    return job.delta

  def next_key(self) -> jax.Array:
    """A fresh PRNG key of the run's key stream."""
    self.key, key = jax.random.split(self.key)
    return key

  def faulty(self, worker: int) -> bool:
    """Counts ``worker``'s arrival; True if the fault switch poisons this one."""
    self.state.arrivals[worker] += 1
    fault = self.spec.fault
    if fault.kill_worker == worker and fault.arrival == self.state.arrivals[worker]:
      self.runtime.kill_worker(worker)
    return fault.worker == worker and fault.arrival == self.state.arrivals[worker]

  def reject(self, worker: int, reason: str, staleness: int, units: int) -> None:
    """A ``rejected`` row for ``worker``'s non-finite pseudo-gradient of ``units`` units."""
    self.state.rejected += 1
    self.state.rejected_units += units
    self.recorder.emit({"event": "rejected", "worker": worker, "reason": reason,
                        "staleness": staleness, "sim_time": self.state.sim_time,
                        "outer_updates": self.state.version})

  # ----------------------------------------------------------------- the loops

  async def run(self, on_row: Optional[Callable[[Row], None]] = None,
                on_checkpoint: Optional[Callable[["Engine"], None]] = None) -> dict[str, Any]:
    """Runs (or, after ``load_state``, continues) until a budget ends.

    Args:
      on_row: called with every metrics row as it is emitted.
      on_checkpoint: called with the engine every ``checkpoint_every`` outer
        updates, at a point where ``checkpoint_state()`` is the whole run state.

    Returns:
      The summary (docs/DESIGN.md, summary.json); ``wall_seconds`` adds up
      the wall time of every resumed part.

    Raises:
      DivergenceError: ``rejection_limit`` pseudo-gradients in a row were
        rejected, every one of the run was, or an evaluation is not finite.
      Stopped: ``request_stop`` was called.
    """
    if on_row is not None:
      self.recorder.on_row = on_row
    self._on_checkpoint = on_checkpoint
    self._wall_start = time.perf_counter()
    s = self.state
    self.clock.start(s.sim_time)
    if s.phase is None:
      self.evaluate(force=True)
      s.initial_eval = s.last_eval
    try:
      await loops.LOOPS[self.method.synchrony](self)
      self.streak.check_end(s.version)
      if s.version == 0 and s.units == 0:
        self._no_work()
    finally:
      self.recorder.flush()  # the rows up to a DivergenceError are kept too
    if self.eval_fn is not None and (s.last_eval[self.spec.unit] != s.units
                                     or s.last_eval["sim_time"] != s.sim_time):
      self.evaluate(force=True)
    wall = s.wall_before + time.perf_counter() - self._wall_start
    unit = self.spec.unit
    summary = {"method": self.method.name, "seed": self.spec.seed, unit: s.units,
               f"applied_{unit}": s.units - s.rejected_units,
               f"rejected_{unit}": s.rejected_units, "rejected": s.rejected,
               "sim_time": s.sim_time, "outer_updates": s.version}
    if self.eval_fn is not None:
      summary["initial_val_loss"] = s.initial_eval["val_loss"]
      summary["final_val_loss"] = s.last_eval["val_loss"]
    summary.update({
        "mean_staleness": float(np.mean(s.staleness)) if s.staleness else 0.0,
        "wall_seconds": wall, f"{unit}_per_second": s.units / wall,
        "num_params": self.num_params})
    return summary

  def _no_work(self) -> None:
    """Raises ``BudgetError``: the run ended with no work applied and none rejected."""
    spec = self.spec
    if self.method.synchrony == "step":
      what, steps = "DDP step of all workers", spec.num_workers
    else:
      what, steps = "dispatch", spec.inner_steps
    raise BudgetError(
        f"the budget ended before any work reached the server (budget: {spec.budget.units} "
        f"{spec.unit} and {spec.budget.sim_seconds} s, 0 = none); allowed: a budget that holds "
        f"at least one {what}, {steps * spec.units_per_step} {spec.unit}, and its time")

  def close(self) -> None:
    """Releases the runtime's resources (Ray: its actors); θ is gone after."""
    self.runtime.close()


def require_no_event_loop(call: str, instead: str) -> None:
  """Raises a RuntimeError saying what to use when ``call`` would nest event loops.

  ``asyncio.run`` is not allowed inside a running event loop (a Jupyter kernel).
  """
  try:
    asyncio.get_running_loop()
  except RuntimeError:
    return
  raise RuntimeError(f"{call} cannot run inside a running event loop (e.g. a Jupyter kernel); "
                     f"use {instead} instead.")
