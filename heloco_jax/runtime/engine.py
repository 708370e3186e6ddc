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

Faults (``heloco_jax.training.rejection``): a non-finite pseudo-gradient (or one an
aggregation screen refuses, ``hj.aggregate.screen``) is rejected before the outer rule,
with a ``{"event": "rejected"}`` row and its ``reason`` (counted in the summary's
``rejected_by``); the worker restarts with a fresh optimizer state. After
``RunSpec.rejection_limit`` rejections in a row (default K, at least 2), at the end
of a run in which every arrival was rejected, or when an evaluation is not finite,
the run stops with a ``DivergenceError`` naming the workers and the cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import signal
import threading
import time
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import jax
import numpy as np

from heloco_jax.training import aggregate as aggregate_lib
from heloco_jax.comm import compress
from heloco_jax.comm import fragments as fragments_lib
from heloco_jax.comm import uplink as uplink_lib
from heloco_jax.runtime import base, loops
from heloco_jax.runtime import state as state_lib
from heloco_jax.runtime.base import Job
from heloco_jax.runtime.state import Recorder, Run, RunSpec, RunState, WorkerStream
from heloco_jax.training import checks, rejection
from heloco_jax.training import model_state as model_state_lib
from heloco_jax.training import server as server_lib

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


class Engine:
  """One run of ``spec`` on ``runtime``; built by ``hj.make_engine``.

  Args:
    spec: the ``RunSpec``.
    runtime: where work runs, what time is, how arrivals queue (``base.Runtime``).
    params: the initial θ (any pytree).
    data: K per-worker iterables of batches (pytrees of arrays), or their
      ``WorkerStream``s.
    outer_tx: the outer rule (None for DDP).
    eval_fn: ``params -> loss`` or ``-> {"val_loss": ..., ...}`` (``(params, *, state)``
      with a model state); None: no evaluations.
    lookahead: dispatch from θ − η·μ·m.
    compressor: workers compress their Δ (``heloco_jax.comm.compress``); None: sent as it is.
    download_compressor: θ's downloads are compressed (``heloco_jax.comm.downlink``;
      asynchronous methods); None: sent as it is.
    model_state: the initial model state besides θ (``heloco_jax.training.model_state``), for a
      ``loss_fn`` that takes ``state``; None: none.
    model_state_merge: how the server merges the workers' model states ("mean", "latest").
    on_row: ``run``'s default row callback.
    handle_signals: ``run`` stops at the next outer update on SIGTERM and Ctrl-C.
    packed_outer: the server holds θ and the outer state packed (``OuterServer``'s
      ``packed``; ``server.packs_outer`` decides it from the runtime factory's ``outer_layout``).
  """

  def __init__(self, spec: RunSpec, runtime: base.Runtime, params: Any,
               data: Sequence[Iterable[Any]], outer_tx: Any = None,
               eval_fn: Optional[Callable[..., Any]] = None, lookahead: bool = False,
               compressor: Optional[compress.Compressor] = None, model_state: Any = None,
               model_state_merge: str = "mean",
               download_compressor: Optional[compress.Compressor] = None,
               on_row: Optional[Callable[[Row], None]] = None, handle_signals: bool = False,
               packed_outer: bool = False):
    if len(data) != spec.num_workers:
      raise ValueError(f"data holds {len(data)} worker streams; allowed: one per worker "
                       f"(num_workers={spec.num_workers})")
    if spec.method.outer is not None and outer_tx is None:
      raise ValueError(f"method={spec.method.name!r} needs an outer rule (outer_tx)")
    executor = runtime.executor
    streams = [source if isinstance(source, WorkerStream) else WorkerStream(source, worker=i)
               for i, source in enumerate(data)]
    state_lib.share_first_batch(streams)
    if spec.method.synchrony not in executor.synchronies:
      raise ValueError(
          f"method={spec.method.name!r} is not allowed on {executor.describe()}; allowed: "
          f"methods whose synchrony is one of {sorted(executor.synchronies)} (this one's is "
          f"{spec.method.synchrony!r})")
    if compressor is not None and spec.method.synchrony == "step":
      raise ValueError(f"compression is not allowed with method={spec.method.name!r}; "
                       "allowed: methods that send pseudo-gradients (all but ddp)")
    if compressor is not None and not getattr(executor, "compresses", False):
      raise ValueError(f"compression is not allowed on {executor.describe()}; allowed: the "
                       "simulated runtime, runtime=devices and Ray")
    if download_compressor is not None:
      _check_download(spec, executor)
    pending = getattr(executor, "pending_memory", "device")  # only asynchronous starts wait
    if pending != "device" and (spec.method.synchrony != "async" or spec.streaming
                                or download_compressor is not None):
      raise ValueError(f"pending_memory={pending!r} is not allowed with method="
                       f"{spec.method.name!r}, fragments or compressed downloads; allowed: "
                       "'device', or an asynchronous method with θ whole, sent uncompressed")
    self.spec = spec
    self.method = spec.method
    self.on_row = on_row
    self.handle_signals = bool(handle_signals)
    if 0 < spec.budget.units < self._smallest_work(spec):
      self._no_work()  # before any work: no batch read, nothing compiled
    self.runtime = runtime
    self.num_params = int(sum(np.size(x) for x in jax.tree.leaves(params)))
    model_bytes = sum(int(np.size(x)) * np.dtype(x.dtype).itemsize
                      for x in jax.tree.leaves(params))
    self.eval_fn = eval_fn
    fragments = fragments_lib.split(params, spec.fragments, spec.fragment_layout)
    make_server = (functools.partial(executor.make_server, packed=True) if packed_outer
                   else executor.make_server)
    if spec.syncer.aggregate != aggregate_lib.Mean():  # ALGORITHMS.md, "Aggregation"
      make_server = functools.partial(make_server, aggregate=spec.syncer.aggregate)
    if spec.streaming:
      server = server_lib.FragmentServers(make_server, outer_tx, params, fragments,
                                          lookahead=lookahead,
                                          fetch=lambda point: executor.fetch(point, "point"))
    else:
      server = make_server(outer_tx, params, lookahead=lookahead)
    uplink = uplink_lib.Uplink(compressor, params, fragments, spec.syncer.aggregate)
    downlink = (executor.make_downlink(download_compressor, params, server, fragments)
                if download_compressor is not None else None)
    clock = runtime.clock(base.ClockSettings(
        np.asarray(spec.seconds_per_step, float), spec.jitter, spec.seed, spec.comm,
        model_bytes, uplink.bytes_up,
        downlink.fragment_bytes if downlink is not None else uplink.bytes_down,
        spec.overlap_steps), executor)
    recorder = Recorder(spec.metrics_fetch_every)
    self._run = Run(
        spec=spec, executor=executor, clock=clock, server=server, uplink=uplink,
        downlink=downlink, fragments=fragments,
        arrivals=lambda: runtime.arrivals(clock, executor, recorder.emit),
        streams=streams, recorder=recorder,
        state=RunState(next_checkpoint=spec.checkpoint_every),
        features=state_lib.Features(rejection=rejection.RejectionState(
            limit=spec.rejection_limit or rejection.default_limit(spec.num_workers)),
            **runtime.features),
        key=jax.random.key(spec.seed),
        model_states=model_state_lib.ModelStates(
            executor.to_server(model_state) if model_state is not None else None,
            model_state_merge, spec.num_workers, spec.seed, executor.inner.contract.rng,
            to_server=executor.to_server,
            # an Executor without rounds (not a RoundExecutor) has no to_rounds
            to_rounds=getattr(executor, "to_rounds", executor.to_server)))
    self._on_checkpoint: Optional[Callable[[Engine], None]] = None
    self.stop_requested: Optional[str] = None
    self.stopped: Optional[str] = None  # why the run ended before its budget (every worker left)
    self._wall_start = time.perf_counter()
    self.directory: Any = None  # a workdir's RunDirectory (``attach``)
    self.resumed_from: Optional[int] = None
    self.workdir_notes: list[str] = []

  def attach(self, directory: Any, resumed_from: Optional[int], notes: list[str]) -> None:
    """Writes the run's rows, checkpoints and summary to ``directory`` (a
    ``workdir.RunDirectory`` that has restored the run: ``resumed_from`` its step, None for a
    new run; ``notes`` its warnings).

    ``rows`` then holds the rows of the earlier parts too (``metrics.jsonl``
    up to the restored checkpoint), so that they are the whole run's.
    """
    self.directory, self.resumed_from, self.workdir_notes = directory, resumed_from, notes
    self._run.recorder.rows[:0] = directory.rows_so_far()

  # θ and the outer state live on the server (``heloco_jax.training.server``).

  @property
  def params(self) -> Any:
    return self._run.server.params

  @property
  def layout(self) -> Any:
    """The server's θ layout (``heloco_jax.training.sharding.Layout``; None: θ is not sharded)."""
    return self._run.server.layout

  @property
  def outer_state(self) -> Any:
    return self._run.server.outer_state

  @property
  def model_state(self) -> Any:
    """The server's copy of the model state (``heloco_jax.training.model_state``; None: none)."""
    return self._run.model_states.merged

  @property
  def server(self) -> Any:
    return self._run.server

  @property
  def clock(self) -> Any:
    return self._run.clock

  @property
  def state(self) -> RunState:
    return self._run.state

  @property
  def features(self) -> state_lib.Features:
    """Each feature's own state (streaming's anchors, the compressors' residuals, ...)."""
    return self._run.features

  @property
  def rows(self) -> list[Row]:
    return self._run.recorder.rows

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

  def snapshot(self) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole run state at a loop boundary: (arrays, JSON-serialisable meta)."""
    run, s = self._run, self.state
    for worker in s.jobs:
      run.compute(worker)
    params, outer_state = run.server.get()
    fetch = run.executor.fetch  # Ray: waits for work still in flight
    arrays = {"params": params, "outer_state": outer_state,
              "key": jax.random.key_data(run.key),
              "workers": fetch(s.workers, "state"),
              "pending": [fetch(s.jobs[w].delta, "delta") for w in sorted(s.jobs)]}
    for _, feature in run.features.items():  # a feature's arrays only when it has them:
      arrays.update(state_lib.arrays_of(feature))  # earlier checkpoints stay readable
    if "compression" in arrays:  # Ray: a worker's state may be a handle, in flight
      arrays["compression"] = [fetch(states, "compression") for states in arrays["compression"]]
    for name in ("downlink", "anchors"):  # Ray: a worker's x̂ (its anchors) is its dispatch's
      if name in arrays:
        arrays[name] = fetch(arrays[name], "held")
    if run.model_states.merged is not None:  # the key only then, as for the features'
      arrays["model_state"] = run.model_states.merged
    meta = state_lib.entry_of(s)
    if self.spec.syncer.aggregate.history:  # a screen's accepted norms (the server's)
      meta["screen_history"] = run.server.history()
    meta["jobs"] = [[w, job.version, job.units, job.finish] for w, job in sorted(s.jobs.items())]
    meta.update({name: state_lib.entry_of(feature) for name, feature in run.features.items()})
    if s.phase == "async":  # workers not dispatched yet (joining later) have no state
      meta["unstarted"] = [w for w, x in enumerate(s.workers) if x is None]
      meta["carried"] = not self.spec.streaming  # each state its ``InnerLoop.carry``
    for entry, w in zip(meta["jobs"], sorted(s.jobs)):
      loss = fetch(s.jobs[w].train_loss, "train_loss")
      entry.append(None if loss is None else
                   jax.tree.map(float, loss) if isinstance(loss, dict) else float(loss))
    meta["wall_before"] = s.wall_before + time.perf_counter() - self._wall_start
    meta["clock"] = run.clock.get_state()
    meta["streams"] = [stream.get_state() for stream in run.streams]
    return arrays, meta

  def template(self, meta: dict[str, Any]) -> dict[str, Any]:
    """The abstract arrays of a ``snapshot()`` with this ``meta`` (for restoring)."""
    params = self.params  # once: a packed server unpacks θ at every read
    worker = jax.eval_shape(self._run.executor.inner.start, params,
                            self._run.model_states.seed_state(0)
                            if self._run.model_states.active else None)
    k = self.spec.num_workers
    stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((k, *x.shape), x.dtype), worker)
    kept = self._run.executor.inner.carry(worker) if meta.get("carried") else worker
    workers = {None: None, "ddp": worker, "rounds": stacked,
               "async": [None if w in meta.get("unstarted", ()) else kept
                         for w in range(k)]}[meta["phase"]]
    template = {"params": params, "outer_state": self.outer_state,
                "key": jax.random.key_data(self._run.key), "workers": workers,
                "pending": [params] * len(meta["jobs"])}
    if self.spec.streaming and meta["phase"] == "async":  # each job's Δ: one fragment's
      syncs = meta.get("streaming", meta)["syncs"]  # (a flat meta: written before entries)
      template["pending"] = [self._run.fragments.take(params,
                                                      syncs[entry[0]] % self.spec.fragments)
                             for entry in meta["jobs"]]
    run = self._run
    if run.uplink.compressor is not None and meta["phase"] in ("rounds", "async"):
      states = [jax.eval_shape(run.uplink.compressor.init, run.fragments.take(params, p))
                for p in range(run.fragments.num)]
      template["compression"] = (
          [jax.tree.map(lambda x: jax.ShapeDtypeStruct((k, *x.shape), x.dtype), state)
           for state in states] if meta["phase"] == "rounds" else [states] * k)
    if self.spec.streaming and meta["phase"] == "async":
      template["anchors"] = [params] * k
    if run.downlink is not None and meta["phase"] == "async" and not self.spec.streaming:
      template["downlink"] = [params] * k
    if run.model_states.merged is not None:
      template["model_state"] = run.model_states.merged
    template.update(run.features.replay.template(meta.get("replay", {}), params))
    if self.layout is None:
      return template
    # Sharded θ: restored where an uninterrupted run holds each array.
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        template, self.layout.shardings(template))

  def restore(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
    """Continues from a ``snapshot()`` of a run with the same spec."""
    run = self._run
    run.server.set(arrays["params"], arrays["outer_state"])
    run.key = jax.random.wrap_key_data(arrays["key"])
    arrays = dict(arrays)
    if self.layout is not None:  # back where an uninterrupted run holds them
      for name in ("pending", "workers", "compression", "downlink", "anchors", "replayed"):
        if name in arrays:
          arrays[name] = self.layout.put(arrays[name])
    elif "compression" in arrays:  # on the host, as ``Uplink.init`` makes them
      arrays["compression"] = jax.device_get(arrays["compression"])
    state_lib.load_entry(run.state, meta, arrays)
    # A job's entry: [worker, version, units, finish, train loss (absent before it was kept)].
    run.state.jobs = {entry[0]: Job(delta, *entry[1:4], train_loss=(entry + [None])[4])
                      for entry, delta in zip(meta["jobs"], arrays["pending"])}
    for name, feature in run.features.items():  # a flat meta: written before entries
      state_lib.load_entry(feature, meta.get(name, meta), arrays)
    if "model_state" in arrays:
      run.model_states.merged = run.executor.to_server(arrays["model_state"])
    if "screen_history" in meta:
      run.server.set_history(meta["screen_history"])
    if run.features.downlink.held is not None and self.layout is None:  # where θ is
      run.features.downlink.held = run.executor.to_server(run.features.downlink.held)
    run.clock.set_state(meta["clock"])
    for stream, position in zip(run.streams, meta["streams"], strict=True):
      stream.set_state(position)

  def request_stop(self, reason: str = "request_stop()") -> None:
    """Asks the run to stop at its next loop boundary, after a checkpoint (preemption).

    Safe to call from a signal handler: it only sets a flag. ``run`` then
    raises ``Stopped``; the same run, restored from that checkpoint, ends as
    an uninterrupted one would.
    """
    self.stop_requested = reason

  def _maybe_checkpoint(self) -> None:
    """At a loop boundary: the checkpoint hook every ``checkpoint_every`` outer updates,
    and before a requested stop (then raises ``Stopped``)."""
    every, s = self.spec.checkpoint_every, self.state
    due = every > 0 and s.version >= s.next_checkpoint
    if not (due or self.stop_requested):
      return
    if due:
      s.next_checkpoint = (s.version // every + 1) * every
    self._run.recorder.flush()  # the checkpoint's rows are all written before it
    if self._on_checkpoint is not None:
      self._on_checkpoint(self)
    if self.stop_requested:
      raise Stopped(self.stop_requested, checkpointed=self._on_checkpoint is not None)

  def _evaluate(self, force: bool = False) -> None:
    """An eval row when the unit count has passed the next eval point (or forced)."""
    s, evaluation = self.state, self._run.features.evaluation
    if self.eval_fn is None or (not force and s.units < evaluation.next_eval):
      return
    every = self.spec.eval_every
    evaluation.next_eval = (s.units // every + 1) * every if every > 0 else math.inf
    metrics = checks.eval_metrics(self._call_eval())
    bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
    if bad:
      where = ("before training" if s.version == 0 and s.units == 0
               else f"after {s.version} outer updates")
      raise rejection.DivergenceError(
          f"the evaluation {where} is not finite ({', '.join(f'{k}={v}' for k, v in bad.items())})"
          ": the run diverged" + (", or the model cannot take the data (e.g. a token id outside "
                                  "the vocabulary)" if s.version == 0 else ""))
    row = {"event": "eval", self.spec.unit: s.units, "sim_time": s.sim_time,
           "outer_updates": s.version}
    if row.keys() & metrics.keys():
      raise ValueError(f"eval_fn returned {sorted(row.keys() & metrics.keys())}, the eval "
                       f"row's own keys ({', '.join(row)}); allowed: other names")
    row.update(metrics)
    evaluation.last_eval = row
    self._run.recorder.emit(row)

  def _call_eval(self) -> Any:
    """``eval_fn`` on θ, and on the server's model state for an ``eval_fn`` that takes
    ``state``. It runs as given: an ``eval_fn`` wrapped in ``jax.jit`` runs compiled
    (docs/DESIGN.md, "Model state and randomness")."""
    if self._run.model_states.merged is not None and checks.takes_keyword(self.eval_fn,
                                                                          "state"):
      return self.eval_fn(self.params, state=self.model_state)
    return self.eval_fn(self.params)

  # ----------------------------------------------------------------- the run

  async def run(self, on_row: Optional[Callable[[Row], None]] = None,
                on_checkpoint: Optional[Callable[["Engine"], None]] = None) -> dict[str, Any]:
    """Runs (or, after ``restore``, continues) until a budget ends.

    With ``handle_signals`` (``make_engine``'s), SIGTERM and Ctrl-C stop it at the next
    outer update (``stop_on_signals``).

    Args:
      on_row: called with every metrics row as it is emitted; None: ``self.on_row``
        (``make_engine``'s).
      on_checkpoint: called with the engine every ``checkpoint_every`` outer
        updates, at a point where ``snapshot()`` is the whole run state.

    Returns:
      The summary (docs/DESIGN.md, summary.json); ``wall_seconds`` adds up
      the wall time of every resumed part.

    Raises:
      DivergenceError: ``rejection_limit`` pseudo-gradients in a row were
        rejected, every one of the run was, or an evaluation is not finite.
      Stopped: ``request_stop`` was called.
    """
    with stop_on_signals(self) if self.handle_signals else contextlib.nullcontext():
      return await self._run_to_the_end(self.on_row if on_row is None else on_row,
                                        on_checkpoint)

  async def _run_to_the_end(self, on_row: Optional[Callable[[Row], None]],
                            on_checkpoint: Optional[Callable[["Engine"], None]]
                            ) -> dict[str, Any]:
    run, s, directory = self._run, self.state, self.directory
    evaluation = run.features.evaluation
    if directory is not None:
      def record(row: Row, on_row=on_row) -> None:
        directory.write_row(row)
        if on_row is not None:
          on_row(row)
      on_row, on_checkpoint = record, on_checkpoint or directory.on_checkpoint
    if on_row is not None:
      run.recorder.on_row = on_row
    self._on_checkpoint = on_checkpoint
    self._wall_start = time.perf_counter()
    run.clock.start(s.sim_time)
    if s.phase is None:
      self._evaluate(force=True)
      evaluation.initial_eval = evaluation.last_eval
    try:
      async for _ in loops.LOOPS[self.method.synchrony](run):  # after each outer update
        self._evaluate()
        self._maybe_checkpoint()
        await asyncio.sleep(0)
      run.features.rejection.check_end(s.version)
      gone = self.spec.membership.everyone_gone(self.spec.num_workers)
      if s.version == 0 and s.units == 0:
        if gone is not None:
          raise BudgetError(
              f"every worker left for good by {gone:g} s, before any work reached the "
              "server; allowed: a failure schedule in which some worker stays or comes back "
              "(docs/FAILURES.md)")
        self._no_work()
      if gone is not None and not self.spec.budget.over(s.units, gone):
        self.stopped = f"every worker left at {gone:g} s"
    finally:
      run.recorder.flush()  # the rows up to a DivergenceError are kept too
    failed = None
    if self.eval_fn is not None and (evaluation.last_eval[self.spec.unit] != s.units
                                     or evaluation.last_eval["sim_time"] != s.sim_time):
      try:
        self._evaluate(force=True)
      except rejection.DivergenceError:
        raise  # a non-finite evaluation is the run's end (docs/DESIGN.md, summary.json)
      except Exception as error:  # pylint: disable=broad-except
        # What was trained is kept: summary.json and the result, with the reason and a
        # warning (docs/DESIGN.md, summary.json); the first evaluation was checked whole.
        first = (str(error).strip().splitlines() or [""])[0]
        failed = f"{type(error).__name__}: {first}"
        warnings.warn(f"the evaluation at the end failed: {failed}; summary's final_val_loss "
                      "is null and final_eval_error says why", stacklevel=2)
    summary = self._summary()
    if failed is not None:
      summary["final_eval_error"] = failed
    if directory is not None:
      directory.finish(summary)
    return summary

  def _summary(self) -> dict[str, Any]:
    s, unit, f = self.state, self.spec.unit, self._run.features
    rejected, membership, traffic = f.rejection, f.membership, f.traffic
    wall = s.wall_before + time.perf_counter() - self._wall_start
    summary = {"method": self.method.name, "seed": self.spec.seed, unit: s.units,
               **({"stopped": self.stopped} if self.stopped else {}),
               f"applied_{unit}": s.units - rejected.rejected_units,
               f"rejected_{unit}": rejected.rejected_units, "rejected": rejected.rejected,
               "rejected_by": dict(sorted(rejected.rejected_by.items())),
               "sim_time": s.sim_time, "outer_updates": s.version}
    if self.spec.membership.absences:  # every dispatched unit, accounted for (FAILURES.md)
      dispatched, dropped = membership.dispatched_units, membership.dropped_units
      summary.update({f"dispatched_{unit}": dispatched, f"dropped_{unit}": dropped,
                      f"in_flight_{unit}": dispatched - s.units - dropped,
                      "goodput": (s.units - rejected.rejected_units) / max(
                          1, s.units + dropped)})
    if self.eval_fn is not None:
      last = f.evaluation.last_eval or {}
      at_end = last.get(unit) == s.units and last.get("sim_time") == s.sim_time
      summary["initial_val_loss"] = (f.evaluation.initial_eval or {}).get("val_loss")
      summary["final_val_loss"] = last.get("val_loss") if at_end else None
    summary.update({
        "mean_staleness": float(np.mean(s.staleness)) if s.staleness else 0.0,
        "bytes_sent": traffic.bytes_sent, "peak_bytes_per_sync": traffic.peak_bytes_per_sync,
        "network_seconds": traffic.network_seconds,  # the link's, on either clock
        "wall_seconds": wall, f"{unit}_per_second": s.units / wall,
        "num_params": self.num_params})
    return summary

  @staticmethod
  def _smallest_work(spec: RunSpec) -> int:
    """The units of the smallest work that can reach the server: a DDP step of all workers,
    a round's, or the shortest dispatch's."""
    k, u = spec.num_workers, spec.units_per_step
    if spec.method.inner == "palsgd":  # pseudo-sync steps count no units
      return u
    if spec.method.synchrony == "step":
      return k * u
    if spec.method.synchrony == "round":
      return k * spec.inner_steps * u
    # the first update waits for a quorum of arrivals (without a timeout): the q shortest
    return int(np.sort(loops.steps_per_dispatch(spec))[:Engine._quorum(spec)].sum()) * u

  @staticmethod
  def _quorum(spec: RunSpec) -> int:
    """Arrivals the first outer update needs (a quorum closes earlier only on a timeout)."""
    return spec.syncer.quorum if math.isinf(spec.syncer.timeout) else 1

  def _no_work(self) -> None:
    """Raises ``BudgetError``: no work fits the budget (or none reached the server)."""
    spec = self.spec
    quorum = self._quorum(spec)
    what = {"step": "DDP step of all workers", "round": "round of all workers"}.get(
        spec.method.synchrony, "dispatch" if quorum == 1 else f"quorum of {quorum} dispatches")
    raise BudgetError(
        f"the budget ended before any work reached the server (budget: {spec.budget.units} "
        f"{spec.unit} and {spec.budget.sim_seconds} s, 0 = none); allowed: a budget that holds "
        f"at least one {what}, {self._smallest_work(spec)} {spec.unit}, and its time")

  def close(self) -> None:
    """Releases the runtime's resources (Ray: its actors) and the workdir; θ is gone after."""
    try:
      self.runtime.close()
    finally:
      if self.directory is not None:
        self.directory.close()


def _check_download(spec: RunSpec, executor: base.Executor) -> None:
  """Refuses compressed downloads where they are not built, in one line (ALGORITHMS.md,
  "Compressed downloads")."""
  refused = "compress=hj.Compression(down=...) is not allowed"
  if spec.method.synchrony != "async":
    raise ValueError(f"{refused} with method={spec.method.name!r}; allowed: the asynchronous "
                     "methods (async_nesterov, delayed_nesterov, mla, heloco, cgad)")
  if not getattr(executor, "compresses_downloads", False):
    raise ValueError(f"{refused} on {executor.describe()}; allowed: the simulated runtime, "
                     "runtime=devices in one process, and Ray")


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


@contextlib.contextmanager
def stop_on_signals(engine: Engine) -> Iterator[None]:
  """SIGTERM (how Cloud TPU and spot VMs announce a preemption) and a first Ctrl-C stop
  ``engine`` at its next outer update, after a checkpoint: ``run`` raises ``Stopped``. A
  second Ctrl-C stops at once (``KeyboardInterrupt``). Outside the main thread (where
  Python runs signal handlers) it does nothing.

  Example::

    engine = hj.make_engine(loss_fn, params, data, workdir="run", budget_steps=10_000)
    with hj.stop_on_signals(engine):
      summary = asyncio.run(engine.run())
  """
  def stop_at_the_next_boundary(signum, frame):
    del frame
    if engine.stop_requested and signum == signal.SIGINT:
      raise KeyboardInterrupt  # a second Ctrl-C: at once, from the last checkpoint
    engine.request_stop(signal.Signals(signum).name)
  handlers = {}
  if threading.current_thread() is threading.main_thread():
    handlers = {signum: signal.signal(signum, stop_at_the_next_boundary)
                for signum in (signal.SIGTERM, signal.SIGINT)}
  try:
    yield
  finally:
    for signum, handler in handlers.items():
      signal.signal(signum, handler)
