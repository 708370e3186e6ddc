"""The public engine API: ``hj.simulate`` runs any model, loss, data and optimizers.

::

  import heloco_jax as hj
  result = hj.simulate(loss_fn, params, data, method="heloco", inner_steps=20,
                       speeds="severe", budget_steps=2_000, eval_fn=eval_fn)
  result.params, result.history, result.summary

``loss_fn(params, batch)`` returns a scalar loss or ``(loss, aux)``;
``params`` is any pytree (a dict, or ``nnx.state(model, nnx.Param)``);
``data`` holds one iterable of batches (pytrees of arrays) per worker. The
method (docs/ALGORITHMS.md) supplies the outer rule, the dispatch rule and
the default inner optimizer; ``outer_tx`` and ``inner_tx`` replace them with
any optax transform or chain.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import warnings
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import jax
import numpy as np
import optax

from heloco_jax import clock, determinism, inner as inner_lib, methods, workdir as workdir_lib
from heloco_jax.runtime import engine as engine_lib, simulated, state as state_lib

Row = dict[str, Any]


@dataclasses.dataclass
class SimulationResult:
  """What ``simulate`` returns.

  Attributes:
    params: the final θ, with the structure of the initial params.
    history: the metrics rows in order: ``{"event": "eval", "steps",
      "sim_time", "outer_updates", "val_loss", ...}``, ``{"event":
      "arrival", "worker", "staleness", "steps", "sim_time", "outer_updates",
      "train_loss", ...diagnostics}``, ``{"event": "train", "steps",
      "sim_time", "outer_updates", "train_loss"}`` (synchronous methods) and
      ``{"event": "rejected", "worker", "reason", ...}``.
    summary: steps, simulated time, outer updates, losses, mean staleness,
      wall time (docs/DESIGN.md, summary.json).
  """
  params: Any
  history: list[Row]
  summary: dict[str, Any]


def _positive_int(name: str, value: Any, allow_none: bool = False) -> None:
  if value is None and allow_none:
    return
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name}={value!r} is not allowed; allowed: an integer >= 1"
                     + (" or None" if allow_none else ""))


def _check_palsgd(inner_tx: optax.GradientTransformation, params: Any) -> None:
  state = jax.eval_shape(inner_tx.init, params)
  if not isinstance(state, inner_lib.PalsgdState):
    raise ValueError("inner_tx is not allowed with method='palsgd' unless it is PALSGD's; "
                     "allowed: None (the default) or hj.palsgd_inner(direction, learning_rate, "
                     "...), whose pseudo-sync steps know the inner learning rate")


def make_engine(
    loss_fn: Callable[..., Any],
    params: Any,
    data: Sequence[Iterable[Any]],
    method: str = "heloco",
    outer_tx: Optional[optax.GradientTransformation] = None,
    inner_tx: Optional[optax.GradientTransformation] = None,
    inner_steps: int = 20,
    speeds: Union[str, Sequence[float]] = "severe",
    budget_steps: Optional[int] = None,
    budget_sim_seconds: Optional[float] = None,
    eval_fn: Optional[Callable[[Any], Any]] = None,
    eval_every_steps: Optional[int] = None,
    seed: int = 0,
    runtime: Any = "simulated",
    *,
    lookahead_dispatch: Optional[bool] = None,
    reset_optimizer: Optional[bool] = None,
    outer_options: Optional[dict[str, Any]] = None,
    grace_window: float = 0.0,
    dylu: bool = False,
    jitter: float = 0.0,
    comm: clock.CommModel = clock.CommModel(),
    checkpoint_every: int = 0,
    metrics_fetch_every: int = 16,
    rejection_limit: int = 0,
    deterministic: Optional[bool] = None,
    palsgd_coins: str = "shared",
) -> engine_lib.Engine:
  """The engine of a ``simulate`` call, for ``await engine.run()`` in a notebook.

  Takes the arguments of ``simulate`` (without ``workdir``); see there.
  """
  determinism.require(runtime == "simulated" if deterministic is None else deterministic)
  spec_method = methods.get(method)
  if palsgd_coins not in state_lib.PALSGD_COINS:
    raise ValueError(f"palsgd_coins={palsgd_coins!r} is not allowed; allowed: one of "
                     f"{', '.join(map(repr, state_lib.PALSGD_COINS))}")
  if isinstance(data, (str, bytes)) or not hasattr(data, "__len__") or len(data) < 1:
    raise ValueError("data must be a sequence of K >= 1 per-worker iterables of batches; "
                     f"got {type(data).__name__}")
  num_workers = len(data)
  _positive_int("inner_steps", inner_steps)
  _positive_int("budget_steps", budget_steps, allow_none=True)
  _positive_int("eval_every_steps", eval_every_steps, allow_none=True)
  if budget_sim_seconds is not None and not budget_sim_seconds > 0:
    raise ValueError(f"budget_sim_seconds={budget_sim_seconds!r} is not allowed; allowed: a "
                     "number > 0 or None")
  if budget_steps is None and budget_sim_seconds is None:
    raise ValueError("budget_steps=None and budget_sim_seconds=None is not allowed; allowed: "
                     "at least one budget (a run needs an end)")
  seconds = clock.seconds_per_step(speeds, num_workers)
  if inner_tx is None:
    inner_tx = spec_method.make_inner(inner_lib.InnerConfig())
  elif spec_method.inner == "palsgd":
    _check_palsgd(inner_tx, params)
  if outer_tx is None:
    outer_tx = spec_method.make_outer(num_workers, outer_options)
  reset = spec_method.reset_optimizer if reset_optimizer is None else bool(reset_optimizer)
  inner = inner_lib.InnerLoop(loss_fn, inner_tx, reset)
  spec = state_lib.RunSpec(
      method=spec_method, num_workers=num_workers, inner_steps=inner_steps,
      seconds_per_step=tuple(float(s) for s in seconds), jitter=jitter, comm=comm, dylu=dylu,
      grace_window=grace_window,
      budget=state_lib.Budget(budget_steps or 0, budget_sim_seconds or 0.0),
      eval_every=eval_every_steps or 0,
      checkpoint_every=checkpoint_every, metrics_fetch_every=metrics_fetch_every,
      rejection_limit=rejection_limit, palsgd_coins=palsgd_coins, seed=seed)
  if runtime == "simulated":
    runtime = simulated.SimulatedRuntime(inner)
  elif callable(runtime):  # a factory: (inner loop, spec) -> runtime (devices, Ray)
    runtime = runtime(inner, spec)
  else:
    raise ValueError(f"runtime={runtime!r} is not allowed; allowed: 'simulated', or a factory "
                     "such as hj.devices_runtime(...) or hj.ray_runtime(...)")
  weighting = (outer_options or {}).get("weighting", "constant")
  return engine_lib.Engine(
      spec, runtime, params, data, outer_tx=outer_tx, eval_fn=eval_fn,
      lookahead=spec_method.lookahead_dispatch(lookahead_dispatch),
      arrival_weight=spec_method.arrival_weight(num_workers, weighting))


def simulate(
    loss_fn: Callable[..., Any],
    params: Any,
    data: Sequence[Iterable[Any]],
    method: str = "heloco",
    outer_tx: Optional[optax.GradientTransformation] = None,
    inner_tx: Optional[optax.GradientTransformation] = None,
    inner_steps: int = 20,
    speeds: Union[str, Sequence[float]] = "severe",
    budget_steps: Optional[int] = None,
    budget_sim_seconds: Optional[float] = None,
    eval_fn: Optional[Callable[[Any], Any]] = None,
    eval_every_steps: Optional[int] = None,
    seed: int = 0,
    workdir: Optional[str] = None,
    runtime: Any = "simulated",
    *,
    checkpoint_every: int = 10,
    on_row: Optional[Callable[[Row], None]] = None,
    **options: Any,
) -> SimulationResult:
  """Trains ``params`` with ``method`` on K heterogeneous workers.

  Args:
    loss_fn: ``(params, batch) -> loss`` or ``(loss, aux)``, differentiable in params.
    params: the initial θ (any pytree of arrays).
    data: K per-worker iterables of batches (pytrees of arrays); worker i
      reads ``data[i]``, one batch per inner step. Re-iterables (lists,
      grain datasets) or iterators with ``get_state``/``set_state`` resume
      exactly from a ``workdir``.
    method: a registry name (``heloco_jax.methods.METHODS``): ddp, local_sgd,
      diloco, palsgd, async_nesterov, delayed_nesterov, mla, heloco.
    outer_tx: the outer rule, any optax transform of pseudo-gradients
      (e.g. ``optax.chain(optax.clip_by_global_norm(1.0), hj.heloco(...))``);
      None: the method's (docs/ALGORITHMS.md defaults, ρ = 1/√K).
    inner_tx: the workers' optimizer, any optax transform; None: the
      method's AdamW with warm-up + cosine schedule (``hj.inner_adamw``).
      PALSGD needs ``hj.palsgd_inner(...)``.
    inner_steps: H, local steps per dispatch.
    speeds: a preset name (homogeneous, mild, moderate, severe, mixed) or K
      simulated seconds per step.
    budget_steps: stop before the applied local steps of all workers
      together pass this (the HeLoCo authors' budget).
    budget_sim_seconds: stop before the simulated clock passes this.
    eval_fn: ``params -> loss`` or ``-> {"val_loss": ..., ...}``; evaluated at
      the start, every ``eval_every_steps`` and at the end.
    eval_every_steps: local steps between evaluations.
    seed: PRNG seed (dispatch keys, PALSGD's coins, the clock's jitter).
    workdir: a directory to checkpoint to every ``checkpoint_every`` outer
      updates and to resume from: the same call resumes exactly.
    runtime: "simulated" (deterministic; bit for bit reproducible), or a
      factory ``inner_loop -> runtime`` such as ``hj.devices_runtime(...)``.
    checkpoint_every: outer updates between checkpoints (with ``workdir``).
    on_row: called with every history row as it is emitted (progress).
    **options: ``lookahead_dispatch``, ``reset_optimizer``, ``outer_options``
      (the method's outer keywords, e.g. ``{"learning_rate": 0.5}``),
      ``grace_window``, ``dylu``, ``jitter``, ``comm`` (``hj.CommModel``),
      ``metrics_fetch_every``, ``rejection_limit`` (non-finite pseudo-gradients
      in a row that stop the run; 0 = K, at least 2) and ``deterministic``
      (None: True for the simulated runtime; on a GPU, True needs XLA's
      deterministic ops, see ``hj.enable_deterministic_ops``) and ``palsgd_coins``
      ("shared", the default: all workers pseudo-sync on the same steps, as the
      authors' code; or "independent").

  Returns:
    ``SimulationResult(params, history, summary)``.

  Raises:
    ValueError: an argument is not allowed (the message names it).
    hj.DivergenceError: ``rejection_limit`` pseudo-gradients in a row were
      non-finite, every one of the run was, or an evaluation was.
    hj.DeterminismError: ``deterministic`` on a GPU whose backend started
      without XLA's deterministic ops.
    hj.WorkdirError: ``workdir`` holds a finished run or another run.
  """
  engine_lib.require_no_event_loop(
      "hj.simulate()", "`engine = hj.make_engine(...)`, `summary = await engine.run()`, "
      "`engine.rows` and `engine.params`")
  engine = make_engine(loss_fn, params, data, method, outer_tx, inner_tx, inner_steps, speeds,
                       budget_steps, budget_sim_seconds, eval_fn, eval_every_steps, seed,
                       runtime, checkpoint_every=checkpoint_every if workdir else 0, **options)
  directory = None
  try:
    if workdir is not None:
      directory = workdir_lib.RunDirectory(workdir, _spec_json(engine, options),
                                           engine.spec.checkpoint_every, flag="workdir")
      for note in directory.restore(engine)[1]:  # fallbacks, a lock taken over, ...
        warnings.warn(f"workdir={workdir!r}: {note.removeprefix('warning: ')}", stacklevel=2)

    def record(row: Row) -> None:
      if directory is not None:
        directory.write_row(row)
      if on_row is not None:
        on_row(row)

    summary = asyncio.run(engine.run(
        record, directory.on_checkpoint if directory is not None else None))
    if directory is not None:
      directory.finish(summary)
    return SimulationResult(jax.device_get(engine.params), engine.rows, summary)
  finally:
    if directory is not None:
      directory.close()
    engine.close()


def _spec_json(engine: engine_lib.Engine, options: dict[str, Any]) -> str:
  """The run's settings as JSON (a workdir's config.json): what a resume must match."""
  spec = dataclasses.asdict(engine.spec)
  spec["method"] = engine.spec.method.name
  spec["comm"] = {"latency": engine.spec.comm.latency,
                  "bandwidth": None if math.isinf(engine.spec.comm.bandwidth)
                  else engine.spec.comm.bandwidth,
                  "ddp_overlap": engine.spec.comm.ddp_overlap}
  spec["options"] = options  # JSON as far as it goes; other values by their repr
  spec["params"] = [list(np.shape(x)) for x in jax.tree.leaves(engine.params)]
  return json.dumps(spec, indent=2, sort_keys=True, default=str) + "\n"


RuntimeFactory = Callable[[inner_lib.InnerLoop, state_lib.RunSpec], Any]


def devices_runtime(batch_size: int, group_sizes: Union[str, Sequence[int]] = "",
                    server: int = 0, slowdown: Union[str, Sequence[float]] = ""
                    ) -> RuntimeFactory:
  """``runtime=`` for ``simulate``: each worker on its own group of ``jax.devices()``.

  Args:
    batch_size: the leading size of every batch (split over a group's devices).
    group_sizes: "" (the devices split evenly) or K group sizes.
    server: index into ``jax.devices()`` of the device holding θ and the outer step.
    slowdown: "" or K factors >= 1 (worker i's result arrives after f_i × its compute).
  """
  from heloco_jax.runtime import devices  # pylint: disable=g-import-not-at-top

  def make(inner: inner_lib.InnerLoop, spec: state_lib.RunSpec) -> Any:
    groups = devices.group_devices(spec.num_workers, batch_size, group_sizes, server, slowdown,
                                   synchronous=spec.method.synchrony == "round")
    return devices.DeviceRuntime(inner, groups)
  return make


def ray_runtime(**options: Any) -> RuntimeFactory:
  """``runtime=`` for ``simulate``: a parameter-server actor and one actor per worker.

  Args:
    **options: the fields of ``heloco_jax.runtime.ray.RayOptions`` (address,
      num_cpus, cpus_per_worker, gpus_per_worker, server_gpus, slowdown, ...).
  """
  from heloco_jax.runtime import ray  # pylint: disable=g-import-not-at-top
  ray_options = ray.RayOptions(**options)

  def make(inner: inner_lib.InnerLoop, spec: state_lib.RunSpec) -> Any:
    return ray.RayRuntime(inner, spec.num_workers, ray_options)
  return make
