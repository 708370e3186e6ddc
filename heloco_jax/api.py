"""The public engine API: ``hj.make_engine`` builds every engine; ``hj.simulate`` runs one.

::

  import heloco_jax as hj
  result = hj.simulate(loss_fn, params, data, method="heloco", inner_steps=20,
                       speeds="severe", budget=hj.Budget(steps=2_000), eval_fn=eval_fn)
  result.params, result.history, result.summary

``make_engine`` declares the options once; ``simulate`` takes the same (its
signature is ``make_engine``'s, for pyright and ``help`` alike). Options that
belong together are small frozen objects: ``hj.Budget``, ``hj.Workdir``,
``hj.Streaming``, ``hj.Syncer``, ``hj.Membership``, ``hj.CommModel``; a
method's own knobs go through ``method_options``.

``loss_fn(params, batch)`` returns a scalar loss or ``(loss, aux)``;
``params`` is any pytree (a dict, or ``nnx.state(model, nnx.Param)``);
``data`` holds one iterable of batches (pytrees of arrays) per worker. The
method (docs/ALGORITHMS.md) supplies the outer rule, the dispatch rule and
the default inner optimizer; ``outer_tx`` and ``inner_tx`` replace them with
any optax transform or chain. The CLI (``heloco-jax train``), the science
grids, the notebook and the benchmarks build their engines here too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import json
import math
import numbers
import os
import re
import warnings
from typing import Any, Callable, Iterable, Mapping, Optional, ParamSpec, Sequence, Union

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils

from heloco_jax.training import aggregate as aggregate_lib
from heloco_jax.comm import compress as compress_lib
from heloco_jax.comm import cost
from heloco_jax.comm import fragments as fragments_lib
from heloco_jax.comm import syncer as syncer_lib
from heloco_jax.rundir import workdir as workdir_lib
from heloco_jax.runtime import clocks, factories
from heloco_jax.runtime import engine as engine_lib
from heloco_jax.runtime import state as state_lib
from heloco_jax.training import checks, determinism, methods, sharding
from heloco_jax.training import inner as inner_lib
from heloco_jax.training import membership as membership_lib
from heloco_jax.training import model_state as model_state_lib
from heloco_jax.training import server as server_lib

Row = dict[str, Any]
_P = ParamSpec("_P")


@dataclasses.dataclass
class RunResult:
  """What ``simulate`` returns (``hj.SimulationResult``).

  Attributes:
    params: the final θ, with the structure of the initial params: NumPy
      arrays, or, when the params were sharded, ``jax.Array``s with their
      shardings (never gathered).
    history: every metrics row of the run in order, those of earlier
      (resumed) parts of a ``workdir`` run included; the kinds and keys of
      rows are in docs/DESIGN.md ("metrics.jsonl").
    summary: steps, simulated time, outer updates, losses, mean staleness,
      wall time (docs/DESIGN.md, summary.json).
    model_state: the server's model state at the end (``model_state``'s merge of the
      workers' copies); None without one.
  """
  params: Any
  history: list[Row]
  summary: dict[str, Any]
  model_state: Any = None


SimulationResult = RunResult


@dataclasses.dataclass(frozen=True)
class Workdir:
  """A run directory with its options (``make_engine(workdir=...)`` also takes a plain path).

  Attributes:
    path: the directory: checkpoints, ``metrics.jsonl``, ``config.json``, ``summary.json``.
    checkpoint_every: outer updates between checkpoints (0: off).
    keep_checkpoints: how many of the newest checkpoints to keep.
    allow_config_change: resume although ``config.json`` differs.
    config_json: what ``config.json`` holds (default: the run's settings as
      ``make_engine`` sees them; the CLI writes its resolved config).
    flag: how messages name the directory ("workdir"; the CLI's "--workdir").
    defaults_json: the defaults of ``config_json``'s keys as JSON: a key added
      since the run began, set to its default, does not stop a resume.
    renamed: ``config_json``'s keys renamed since (former -> current, dotted): a
      workdir's ``config.json`` under the former names resumes as under the current.
  """
  path: str
  checkpoint_every: int = 10
  keep_checkpoints: int = 3
  allow_config_change: bool = False
  config_json: Optional[str] = None
  flag: str = "workdir"
  defaults_json: Optional[str] = None
  renamed: Mapping[str, str] = dataclasses.field(default_factory=dict, hash=False)


@dataclasses.dataclass(frozen=True)
class Budget:
  """Where a run ends and how often it is evaluated (``make_engine(budget=...)``).

  A run counts inner steps, or tokens with ``tokens_per_step``; it stops before
  the first of its budgets would be passed, and evaluates at the start, every
  ``eval_every_*`` and at the end.

  Attributes:
    steps: the applied local steps of all workers together (the HeLoCo authors' budget).
    tokens: with ``tokens_per_step``: the budget in tokens.
    sim_seconds: the simulated clock's budget.
    tokens_per_step: the tokens of one worker's inner step (e.g. batch × context):
      budgets, evaluations, rows and the summary then count tokens.
    eval_every_steps: local steps between evaluations (None: start and end only).
    eval_every_tokens: with ``tokens_per_step``: tokens between evaluations.

  Example::

    hj.Budget(steps=2_000, eval_every_steps=200)
    hj.Budget(tokens=10_000_000, tokens_per_step=4 * 128, eval_every_tokens=500_000)
  """
  steps: Optional[int] = None
  tokens: Optional[int] = None
  sim_seconds: Optional[float] = None
  tokens_per_step: Optional[int] = None
  eval_every_steps: Optional[int] = None
  eval_every_tokens: Optional[int] = None


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


def _budget(budget: Any) -> tuple[state_lib.Budget, int, int, str]:
  """(budget, evaluation cadence, units per step, unit) in steps or, with
  ``tokens_per_step``, in tokens."""
  if not isinstance(budget, Budget):
    raise ValueError(f"budget={budget!r} is not allowed; allowed: hj.Budget(steps=...), "
                     "hj.Budget(sim_seconds=...) or hj.Budget(tokens=..., tokens_per_step=...)")
  b = budget
  for name in ("steps", "tokens", "tokens_per_step", "eval_every_steps", "eval_every_tokens"):
    _positive_int(f"budget.{name}", getattr(b, name), allow_none=True)
  for name, value in (("tokens", b.tokens), ("eval_every_tokens", b.eval_every_tokens)):
    if value is not None and b.tokens_per_step is None:
      raise ValueError(f"budget.{name}={value!r} is not allowed without "
                       "budget.tokens_per_step; allowed: budget.tokens_per_step (the tokens "
                       f"of one worker's inner step), or steps: budget."
                       f"{name.replace('tokens', 'steps')}")
  if b.tokens_per_step is not None:
    for name, value in (("steps", b.steps), ("eval_every_steps", b.eval_every_steps)):
      if value is not None:
        raise ValueError(f"budget.{name}={value!r} is not allowed with budget.tokens_per_step; "
                         f"allowed: budget.{name.replace('steps', 'tokens')} (the run counts "
                         "tokens)")
  if b.sim_seconds is not None and (
      isinstance(b.sim_seconds, bool) or not isinstance(b.sim_seconds, numbers.Real)
      or not b.sim_seconds > 0 or not math.isfinite(b.sim_seconds)):
    raise ValueError(f"budget.sim_seconds={b.sim_seconds!r} is not allowed; allowed: a "
                     "finite number > 0 or None")
  tokens = b.tokens_per_step is not None
  units = b.tokens if tokens else b.steps
  if units is None and b.sim_seconds is None:
    raise ValueError(f"budget={b!r} is not allowed; allowed: at least one of steps, tokens "
                     "or sim_seconds (a run needs an end)")
  every = b.eval_every_tokens if tokens else b.eval_every_steps
  return (state_lib.Budget(units or 0, b.sim_seconds or 0.0), every or 0,
          b.tokens_per_step or 1, "tokens" if tokens else "steps")


def _syncer(syncer: Optional[syncer_lib.Syncer], method: Any,
            num_workers: int) -> syncer_lib.Syncer:
  """The run's syncer policy (a one-line ValueError when not allowed)."""
  if syncer is None:
    return syncer_lib.Syncer()
  if not isinstance(syncer, syncer_lib.Syncer):
    raise ValueError(f"syncer={syncer!r} is not allowed; allowed: None or hj.Syncer(...)")
  if method.synchrony != "async" and syncer != syncer_lib.Syncer(aggregate=syncer.aggregate):
    raise ValueError(f"syncer={syncer!r} is not allowed with method={method.name!r}; allowed: "
                     "None or hj.Syncer(aggregate=...) (a syncer groups the arrivals of an "
                     "asynchronous method)")
  refused = (syncer.refusal(num_workers) if method.synchrony == "async"
             else syncer.aggregate_refusal(num_workers, method.synchrony))
  if refused:
    name, value, allowed = refused
    raise ValueError(f"syncer.{name}={value!r} is not allowed; allowed: {allowed}")
  return syncer


def _streaming(streaming: Optional[fragments_lib.Streaming]) -> fragments_lib.Streaming:
  if streaming is None:
    return fragments_lib.Streaming()
  if not isinstance(streaming, fragments_lib.Streaming):
    raise ValueError(f"streaming={streaming!r} is not allowed; allowed: None (θ synced whole) "
                     "or hj.Streaming(fragments=..., ...)")
  _positive_int("streaming.fragments", streaming.fragments)
  return streaming


def _compression(compress: Any) -> tuple[Optional[compress_lib.Compressor],
                                          Optional[compress_lib.Compressor]]:
  """(up, down) of ``compress=``: a ``Compressor`` is ``up``."""
  up, down = ((compress.up, compress.down) if isinstance(compress, compress_lib.Compression)
              else (compress, None))
  for c in (up, down):
    if c is not None and not isinstance(c, compress_lib.Compressor):
      raise ValueError(f"compress={compress!r} is not allowed; allowed: None (sent as it is), "
                       "a heloco_jax.comm.compress.Compressor (e.g. hj.compress.int8()) or "
                       "hj.Compression(up=..., down=...) of them")
  return up, down


def _workdir(workdir: Union[None, str, os.PathLike, Workdir]) -> Optional[Workdir]:
  if workdir is None or isinstance(workdir, Workdir):
    every = None if workdir is None else workdir.checkpoint_every
    if every is not None and (isinstance(every, bool) or not isinstance(every, numbers.Integral)
                              or every < 0):
      raise ValueError(f"workdir.checkpoint_every={every!r} is not allowed; allowed: an "
                       "integer >= 0 (0 = off)")
    return workdir
  if isinstance(workdir, (str, os.PathLike)):
    return Workdir(os.fspath(workdir))
  raise ValueError(f"workdir={workdir!r} is not allowed; allowed: None, a path or "
                   "hj.Workdir(path, ...)")


# make_engine's options that only the simulated clock reads: (name, its no-op value, why), and
# when it still applies on a real clock (docs/DESIGN.md, "Runtimes").
_SIMULATED_CLOCK_ONLY = (
    ("jitter", 0.0, "the simulated clock's per-step jitter; real devices vary by themselves",
     lambda options: False),
    ("speeds", "mixed", "simulated seconds per step; on real devices use "
     "hj.devices_runtime(slowdown=...) or ray_runtime(slowdown=...)",
     lambda options: options["dylu"]),  # DyLU's H_i read them on every runtime
)


def _refuse_on_a_real_clock(**options: Any) -> None:
  """A one-line ValueError for an option a real clock would not apply (nothing is silently
  ignored)."""
  for name, default, why, applies in _SIMULATED_CLOCK_ONLY:
    value = options[name]
    at_default = isinstance(value, (str, float, int)) and value == default
    if not at_default and not applies(options):
      raise ValueError(f"{name}={value!r} is not allowed on a real clock (runtime=devices or "
                       f"ray): {why}; allowed: {default!r}")


def _membership(membership: Optional[membership_lib.Membership], num_workers: int
                ) -> membership_lib.Membership:
  """The run's failure schedule (a one-line ValueError where it cannot run)."""
  if membership is None:
    return membership_lib.Membership()
  if not isinstance(membership, membership_lib.Membership):
    raise ValueError(f"membership={membership!r} is not allowed; allowed: None or "
                     "hj.Membership(...)")
  why = membership.refusal(num_workers)
  if why:
    raise ValueError(f"membership={membership!r} is not allowed: {why}")
  return membership


# Keywords the grouped front door (issue 57) renamed, and their new homes: refused in one
# line naming the new home for at least one release (CHANGELOG.md, as the CLI's
# configs/schema.py RENAMED does for its flags).
RENAMED_KEYWORDS: Mapping[str, str] = {
    "budget_steps": "budget=hj.Budget(steps=...)",
    "budget_tokens": "budget=hj.Budget(tokens=..., tokens_per_step=...)",
    "budget_sim_seconds": "budget=hj.Budget(sim_seconds=...)",
    "tokens_per_step": "budget=hj.Budget(tokens_per_step=...)",
    "eval_every_steps": "budget=hj.Budget(eval_every_steps=...)",
    "eval_every_tokens": "budget=hj.Budget(eval_every_tokens=...)",
    "checkpoint_every": "workdir=hj.Workdir(path, checkpoint_every=...)",
    "fragments": "streaming=hj.Streaming(fragments=...)",
    "fragment_layout": "streaming=hj.Streaming(layout=...)",
    "overlap_steps": "streaming=hj.Streaming(overlap_steps=...)",
    "fragment_alpha": "streaming=hj.Streaming(alpha=...)",
    "grace_window": "syncer=hj.Syncer(grace_window=...)",
    "outer_options": "method_options={...}",
    "lookahead_dispatch": "method_options={'lookahead_dispatch': ...}",
    "dylu": "method_options={'dylu': ...}",
    "palsgd_coins": "method_options={'coins': ...}",
    "palsgd_warmup_steps": "method_options={'warmup_steps': ...}",
}


def refuse_renamed(call: str, options: Mapping[str, Any]) -> None:
  """A keyword of ``RENAMED_KEYWORDS`` in ``options`` as one line naming its new home."""
  for name in options:
    if name in RENAMED_KEYWORDS:
      raise TypeError(f"{call}() got {name}=, which was renamed: use {RENAMED_KEYWORDS[name]} "
                      "(CHANGELOG.md)")


def _refusing_renamed(function: Callable[_P, Any]) -> Callable[_P, Any]:
  """``function`` refusing ``RENAMED_KEYWORDS`` in one line (its signature unchanged)."""
  @functools.wraps(function)
  def call(*args: Any, **kwargs: Any) -> Any:
    refuse_renamed(function.__name__, kwargs)
    return function(*args, **kwargs)
  return call  # type: ignore[return-value]


@_refusing_renamed
def make_engine(
    loss_fn: Callable[..., Any],
    params: Any,
    data: Sequence[Iterable[Any]],
    *,
    method: str = "heloco",
    budget: Budget,
    inner_steps: int = 20,
    speeds: Union[str, Sequence[float]] = "mixed",
    eval_fn: Optional[Callable[..., Any]] = None,
    seed: int = 0,
    outer_tx: Optional[optax.GradientTransformation] = None,
    inner_tx: Optional[optax.GradientTransformation] = None,
    method_options: Optional[Mapping[str, Any]] = None,
    reset_optimizer: Optional[bool] = None,
    syncer: Optional[syncer_lib.Syncer] = None,
    streaming: Optional[fragments_lib.Streaming] = None,
    compress: Union[None, compress_lib.Compressor, compress_lib.Compression] = None,
    membership: Optional[membership_lib.Membership] = None,
    comm: cost.CommModel = cost.CommModel(),
    jitter: float = 0.0,
    model_state: Any = None,
    model_state_merge: model_state_lib.Merge = "mean",
    runtime: Optional[factories.RuntimeFactory] = None,
    workdir: Union[None, str, os.PathLike, Workdir] = None,
    deterministic: Optional[bool] = None,
    rejection_limit: Optional[int] = None,
    metrics_fetch_every: int = 16,
    on_row: Optional[Callable[[Row], None]] = None,
    handle_signals: bool = False,
) -> engine_lib.Engine:
  """The engine of a run, for ``summary = await engine.run()`` (e.g. in a notebook).

  ``hj.simulate`` takes the same arguments and runs the engine to the end;
  ``await engine.run()`` runs it, ``engine.rows`` and ``engine.params`` hold the
  results, ``engine.request_stop()`` stops it at the next outer update (after a
  checkpoint, with ``workdir``), and ``engine.close()`` releases its runtime and
  workdir.

  Args:
    loss_fn: ``(params, batch) -> loss`` or ``(loss, aux)``, differentiable in params;
      the scalars of a dict ``aux`` reach the rows as ``train_<name>``. With the
      keyword ``state`` (the model state besides θ, e.g. BatchNorm statistics) it
      returns ``(loss, (new_state, metrics))``; with the keyword ``rng`` it gets a new
      PRNG key every inner step (docs/DESIGN.md, "Model state and randomness").
    params: the initial θ (any pytree of floating-point arrays).
    data: K per-worker iterables of batches (pytrees of arrays); worker i
      reads ``data[i]``, one batch per inner step. Re-iterables (lists,
      grain datasets) or iterators with ``get_state``/``set_state`` resume
      exactly from a ``workdir``.
    method: a registry name (``heloco_jax.training.methods.METHODS``): ddp, local_sgd,
      diloco, palsgd, async_nesterov, delayed_nesterov, mla, heloco, cgad.
    budget: where the run ends and how often it is evaluated (``hj.Budget``:
      steps, tokens with tokens_per_step, simulated seconds; eval cadence).
    inner_steps: H, local steps per dispatch (DDP: its steps per compiled chunk and
      per metrics row; its trajectory does not depend on it).
    speeds: a preset name (homogeneous, mild, moderate, severe, mixed: the
      HeLoCo authors' 1, 2, 3, 1, 5 and the default) or K simulated seconds per
      step.
    eval_fn: ``params -> loss`` or ``-> {"val_loss": ..., ...}`` (``(params, *, state)``
      with a model state); evaluated at the start, every ``budget.eval_every_*`` and at
      the end, as given (wrap it in ``jax.jit`` to compile it).
    seed: PRNG seed (dispatch keys, PALSGD's coins, the clock's jitter).
    outer_tx: the outer rule, any optax transform of pseudo-gradients
      (e.g. ``optax.chain(optax.clip_by_global_norm(1.0), hj.heloco(...))``);
      None: the method's (docs/ALGORITHMS.md defaults, ρ = 1/√K). It replaces
      the whole rule, ρ included: for an asynchronous method it must hold an
      arrival weight (``hj.scale_by_arrival_weight`` or one of the
      asynchronous rules), and for heloco a ``hj.heloco`` state.
    inner_tx: the workers' optimizer, any optax transform; None: the
      method's AdamW with warm-up + cosine schedule (``hj.inner_adamw``).
      PALSGD needs ``hj.palsgd_inner(...)``.
    method_options: the method's own keyword options. Its outer rule's (with
      ``outer_tx`` None), e.g. ``{"learning_rate": 0.5}``: the keys are
      ``heloco_jax.training.methods.METHODS[method].outer_keys``. Its run's
      (``.run_keys``): ``lookahead_dispatch`` (mla: dispatch from the look-ahead
      point), ``dylu`` (asynchronous methods: H_i = max(1, ⌊v_i/v_ref·H⌋)),
      PALSGD's ``coins`` ("shared": all workers pseudo-sync on the same steps,
      as the authors' code, or "independent") and ``warmup_steps`` (DDP steps
      before its rounds; None: H).
    reset_optimizer: a fresh inner optimizer state at every dispatch; None:
      the method's default (True but for PALSGD). The worker's step count and
      the step counts of the schedules in ``inner_tx``'s state are kept. True is
      refused with DDP (no dispatches).
    syncer: how an asynchronous method groups and merges arrivals
      (``hj.Syncer(quorum=q, timeout=T, grace_window=w, adaptive_grace=κ,
      weights="mean" | "tokens")``, docs/ALGORITHMS.md, "Syncer policies");
      None: one update per arrival.
    streaming: θ synced a fragment at a time (``hj.Streaming(fragments=P,
      layout, overlap_steps=τ, alpha=α)``, docs/ALGORITHMS.md, "Fragments"):
      Streaming DiLoCo for diloco and local_sgd, per-fragment rules for the
      asynchronous methods; None: θ whole. Simulated runtime only.
    compress: workers compress their pseudo-gradients before sending them
      (``hj.compress.int8()``, ``hj.compress.error_feedback(hj.compress.top_k(0.01))``,
      ...; the error-feedback residuals are checkpointed), and the simulated
      clock charges the compressed bytes (docs/ALGORITHMS.md, "Compression in
      a run"); None: Δ is sent as it is. Not with ddp. ``hj.Compression(up=...,
      down=...)`` compresses θ's downloads too: a worker's later dispatches receive
      C(θ_d − x̂), x̂ what it last started from, which the server keeps per worker
      (docs/ALGORITHMS.md, "Compressed downloads"; asynchronous methods; on Ray θ whole,
      and only the message crosses the object store).
    membership: when workers leave and join (``hj.Membership(((worker, leave,
      back), ...))``: crashes, recoveries, new workers; docs/FAILURES.md); None:
      every worker stays. Synchronous methods run elastic rounds and steps (Streaming
      DiLoCo too: a worker that missed a round takes θ whole). On a real clock (devices,
      Ray) in its seconds (DDP's chunks cut by the fastest step timed).
    comm: message and all-reduce costs (``hj.CommModel``).
    jitter: relative per-step jitter of the simulated clock, in [0, 1).
    model_state: the initial model state besides θ (e.g. ``nnx.state(model,
      nnx.BatchStat)``), for a ``loss_fn`` that takes ``state``: each worker carries its
      copy through its steps, and the server merges the copies by ``model_state_merge``.
    model_state_merge: "mean" (a round averages its workers' copies; an asynchronous
      arrival moves the server's copy 1/K of the way to the worker's) or "latest" (the
      arriving worker's copy); non-float leaves take the arriving worker's.
    runtime: None or ``hj.simulated_runtime()`` (deterministic: bit for bit
      reproducible), ``hj.devices_runtime(...)`` or ``hj.ray_runtime(...)``.
    workdir: a directory (or ``hj.Workdir(path, checkpoint_every=10, ...)``) to
      checkpoint to every ``checkpoint_every`` outer updates and to resume from:
      the same call resumes exactly, and ``history`` is then the whole run's.
    deterministic: None: True on a simulated clock; on a GPU, True needs
      XLA's deterministic ops (``hj.enable_deterministic_ops``).
    rejection_limit: rejected pseudo-gradients in a row (non-finite, or refused by an
      aggregation screen) that stop the run; None: K (at least 2).
    metrics_fetch_every: arrival rows whose device scalars are fetched together.
    on_row: called with every history row as it is emitted (progress,
      ``hj.TensorBoardWriter``).
    handle_signals: SIGTERM and Ctrl-C stop the run at the next outer update,
      after a checkpoint (with ``workdir``), raising ``hj.Stopped``; the same
      call then resumes it.

  Returns:
    The engine (``heloco_jax.runtime.engine.Engine``).

  Raises:
    ValueError: an argument is not allowed (the message names it).
    hj.DeterminismError: ``deterministic`` on a GPU whose backend started
      without XLA's deterministic ops.
    hj.WorkdirError: ``workdir`` holds a finished run or another run.
  """
  spec_method = methods.get(method)
  factory = factories.simulated_runtime() if runtime is None else runtime
  if not isinstance(factory, factories.RuntimeFactory):
    raise ValueError(f"runtime={runtime!r} is not allowed; allowed: None (simulated workers), "
                     "hj.simulated_runtime(...), hj.devices_runtime(...) or hj.ray_runtime(...)")
  determinism.require(factory.simulated_clock if deterministic is None else deterministic)
  outer_options, run_options = spec_method.split_options(method_options)
  if not factory.simulated_clock:
    _refuse_on_a_real_clock(jitter=jitter, speeds=speeds,
                            dylu=bool(run_options.get("dylu", False)))
  palsgd_coins = run_options.get("coins", "shared")
  if palsgd_coins not in state_lib.PALSGD_COINS:
    raise ValueError(f"method_options['coins']={palsgd_coins!r} is not allowed; allowed: one "
                     f"of {', '.join(map(repr, state_lib.PALSGD_COINS))}")
  palsgd_warmup_steps = run_options.get("warmup_steps")
  if palsgd_warmup_steps is not None and (
      isinstance(palsgd_warmup_steps, bool)
      or not isinstance(palsgd_warmup_steps, numbers.Integral) or palsgd_warmup_steps < 0):
    raise ValueError(f"method_options['warmup_steps']={palsgd_warmup_steps!r} is not allowed; "
                     "allowed: an integer >= 0, or None (H)")
  if palsgd_warmup_steps is not None:
    palsgd_warmup_steps = int(palsgd_warmup_steps)
  dylu = bool(run_options.get("dylu", False))
  if isinstance(data, (str, bytes)) or not hasattr(data, "__len__") or len(data) < 1:
    raise ValueError("data must be a sequence of K >= 1 per-worker iterables of batches; "
                     f"got {type(data).__name__}")
  num_workers = len(data)
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
    raise ValueError(f"seed={seed!r} is not allowed; allowed: an integer in [0, 2**32)")
  _positive_int("inner_steps", inner_steps)
  _positive_int("metrics_fetch_every", metrics_fetch_every)
  compress, compress_download = _compression(compress)
  if budget is None:
    raise ValueError("budget=None is not allowed; allowed: hj.Budget(steps=...), "
                     "hj.Budget(sim_seconds=...) or hj.Budget(tokens=..., tokens_per_step=...) "
                     "(a run needs an end)")
  workdir = _workdir(workdir)
  if workdir is not None:  # NumPy integers as Python's: config.json is JSON
    workdir = dataclasses.replace(workdir, checkpoint_every=int(workdir.checkpoint_every))
  streaming = _streaming(streaming)
  syncer = _syncer(syncer, spec_method, num_workers)
  membership = _membership(membership, num_workers)
  run_budget, eval_every, units_per_step, unit = _budget(budget)
  model_state_lib.check_params_are_trained(params)
  checks.check_params(params)
  params = sharding.on_auto_axes(params)
  contract = inner_lib.LossContract.of(loss_fn)
  model_state_lib.check_model_state(model_state, contract)
  model_state_lib.check_merge(model_state_merge)
  checks.check_eval_fn(eval_fn, model_state)
  streams = [state_lib.WorkerStream(source, worker=i) for i, source in enumerate(data)]
  checks.check_loss_fn(loss_fn, params, streams[0].peek(), model_state)
  seconds = clocks.seconds_per_step(speeds, num_workers)
  if inner_tx is None:
    inner_tx = spec_method.make_inner(inner_lib.InnerConfig())
  elif spec_method.inner == "palsgd":
    _check_palsgd(inner_tx, params)
  lookahead = spec_method.lookahead_dispatch(run_options.get("lookahead_dispatch"))
  user_outer_tx = outer_tx is not None
  if outer_tx is None:
    outer_tx = spec_method.make_outer(num_workers, outer_options)
  elif outer_options:
    raise ValueError(f"method_options={dict(outer_options)!r} is not allowed with outer_tx; "
                     "allowed: one of them (method_options' outer keys set the method's own "
                     "rule)")
  else:
    checks.check_outer_tx(outer_tx, params, spec_method, lookahead)
  server_lib.check_merge_order(outer_tx, params, syncer.groups)
  try:  # P and the layout, in the names of ``streaming``
    fragments_lib.split(params, streaming.fragments, streaming.layout)
  except ValueError as error:
    raise ValueError(re.sub(r"\bfragment_layout\b", "streaming.layout",
                            re.sub(r"(?<![\w.])fragments=", "streaming.fragments=", str(error)))
                     ) from None
  refused = fragments_lib.refusal(
      method=spec_method, fragments=streaming.fragments, overlap_steps=streaming.overlap_steps,
      alpha=streaming.alpha, inner_steps=inner_steps,
      reset_optimizer=reset_optimizer,
      grace_window=syncer.grace_window, dylu=dylu, quorum=syncer.quorum,
      adaptive_grace=syncer.adaptive_grace)
  if refused:
    name, value, allowed = refused
    raise ValueError(f"{fragments_lib.PUBLIC_NAMES.get(name, name)}={value!r} is not allowed; "
                     f"allowed: {allowed.replace('fragments=', 'streaming.fragments=')}")
  streaming = dataclasses.replace(  # NumPy scalars as Python's: config.json is JSON
      streaming, fragments=int(streaming.fragments), overlap_steps=int(streaming.overlap_steps),
      alpha=float(streaming.alpha))
  reset = spec_method.resets(reset_optimizer)
  if streaming.fragments > 1:  # workers never restart as a whole (ALGORITHMS.md, "Fragments")
    reset = False
  inner = inner_lib.InnerLoop(loss_fn, inner_tx, reset, layout=sharding.layout_of(params))
  packed_outer = server_lib.packs_outer(
      factory.outer_layout, rule=spec_method.outer is not None, user_rule=user_outer_tx,
      sharded=inner.layout is not None)
  spec = state_lib.RunSpec(
      method=spec_method, num_workers=num_workers, inner_steps=int(inner_steps),
      seconds_per_step=tuple(float(s) for s in seconds), jitter=jitter, comm=comm, dylu=dylu,
      syncer=syncer, membership=membership, palsgd_warmup_steps=palsgd_warmup_steps,
      budget=run_budget,
      eval_every=eval_every, units_per_step=units_per_step, unit=unit,
      checkpoint_every=workdir.checkpoint_every if workdir is not None else 0,
      metrics_fetch_every=int(metrics_fetch_every), rejection_limit=int(rejection_limit or 0),
      palsgd_coins=palsgd_coins, fragments=streaming.fragments,
      fragment_layout=streaming.layout, overlap_steps=streaming.overlap_steps,
      fragment_alpha=float(streaming.alpha), seed=int(seed))
  built = factory(inner, spec)
  try:
    engine = engine_lib.Engine(spec, built, params, streams, outer_tx=outer_tx,
                               eval_fn=eval_fn, lookahead=lookahead, compressor=compress,
                               model_state=model_state, model_state_merge=model_state_merge,
                               download_compressor=compress_download, on_row=on_row,
                               handle_signals=handle_signals, packed_outer=packed_outer)
  except BaseException:
    built.close()  # e.g. Ray's actors, started for a run that cannot be built
    raise
  if workdir is not None:
    try:
      run = checks.fingerprint(loss_fn, params, [stream.peek() for stream in streams],
                                outer_tx, inner_tx, compress, compress_download)
      # the keys of config.json's "options" as they were: older workdirs resume
      settings = dict(outer_options=outer_options, lookahead_dispatch=lookahead,
                      reset_optimizer=reset, deterministic=deterministic, run=run)
      if model_state is not None or contract.rng:  # the keys only then: older workdirs match
        settings["model_state"] = {
            "merge": model_state_merge, "rng": contract.rng,
            "shapes": None if model_state is None else checks.describe_tree(model_state)}
      _open_workdir(engine, workdir, settings=settings)
    except BaseException:
      engine.close()
      raise
  return engine


def _open_workdir(engine: engine_lib.Engine, workdir: Workdir, settings: dict[str, Any]) -> None:
  """Attaches ``workdir`` to ``engine`` and resumes its run; notes come as warnings."""
  config_json = _with_batching(workdir.config_json or _spec_json(engine, settings), engine)
  defaults_json = workdir.defaults_json
  if workdir.config_json is None and defaults_json is None:  # the API's own layout
    defaults_json = _defaults_json(engine)
  directory = workdir_lib.RunDirectory(workdir.path, config_json, engine.spec.checkpoint_every,
                                       workdir.keep_checkpoints, workdir.allow_config_change,
                                       flag=workdir.flag, defaults_json=defaults_json,
                                       renamed=workdir.renamed)
  try:
    engine.attach(directory, *directory.restore(engine))
  except BaseException:
    directory.close()
    raise
  for note in engine.workdir_notes:  # fallbacks, a lock taken over, ...
    warnings.warn(f"{workdir.flag}={workdir.path!r}: {note.removeprefix('warning: ')}",
                  stacklevel=3)


def _with_batching(config_json: str, engine: engine_lib.Engine) -> str:
  """``config_json`` (the API's or the CLI's) with the simulated runtime's ``worker_batching``
  as it runs ("auto" resolved; docs/DESIGN.md, "Worker batching"): recorded, not compared on
  a resume (``workdir_lib.MAY_CHANGE_ON_RESUME``)."""
  batching = getattr(getattr(engine.runtime, "executor", None), "batching", None)
  try:
    config = json.loads(config_json)
  except ValueError:
    return config_json
  if batching is None or not isinstance(config, dict):
    return config_json
  config["worker_batching"] = batching
  return json.dumps(config, indent=2, sort_keys=True, default=str) + "\n"


def _signature_of(declared: Callable[_P, Any]
                  ) -> Callable[[Callable[..., RunResult]], Callable[_P, RunResult]]:
  """Gives the decorated function ``declared``'s parameters (for pyright and ``help``)."""
  def decorate(function: Callable[..., RunResult]) -> Callable[_P, RunResult]:
    function.__signature__ = inspect.signature(declared).replace(  # type: ignore[attr-defined]
        return_annotation=RunResult)
    return function
  return decorate


@_signature_of(make_engine)
def simulate(loss_fn: Callable[..., Any], params: Any, data: Sequence[Iterable[Any]],
             **options: Any) -> RunResult:
  """Trains ``params`` with ``method`` on K heterogeneous workers: ``make_engine`` and
  ``engine.run()`` to the end.

  Args:
    loss_fn: as ``make_engine``'s.
    params: as ``make_engine``'s.
    data: as ``make_engine``'s.
    **options: ``make_engine``'s keyword arguments (``simulate``'s signature is
      ``make_engine``'s, declared there once).

  Returns:
    ``SimulationResult(params, history, summary, model_state)``.

  Raises:
    ValueError: an argument is not allowed (the message names it).
    hj.DivergenceError: ``rejection_limit`` pseudo-gradients in a row were
      non-finite, every one of the run was, or an evaluation was.
    hj.DeterminismError: ``deterministic`` on a GPU whose backend started
      without XLA's deterministic ops.
    hj.WorkdirError: ``workdir`` holds a finished run or another run.
    hj.Stopped: ``handle_signals`` and a signal stopped the run.
  """
  engine_lib.require_no_event_loop(
      "hj.simulate()", "`engine = hj.make_engine(...)`, `summary = await engine.run()`, "
      "`engine.rows` and `engine.params`")
  refuse_renamed("simulate", options)
  unknown = sorted(set(options) - set(inspect.signature(make_engine).parameters))
  if unknown:  # as Python words it for a declared signature
    raise TypeError(f"simulate() got an unexpected keyword argument {unknown[0]!r}")
  engine = make_engine(loss_fn, params, data, **options)
  try:
    summary = asyncio.run(engine.run())
    if summary.get("stopped"):  # before its budget: not a normal-looking end
      warnings.warn(f"the run stopped before its budget: {summary['stopped']} "
                    f"(summary['stopped'])", stacklevel=2)
    if engine.layout is None:
      return RunResult(jax.device_get(engine.params), engine.rows, summary, engine.model_state)
    # Sharded θ stays where it is, with the user's shardings (their mesh's axis types too);
    # across processes through the host (JAX moves arrays between processes no other way).
    def back(x: jax.Array, given: jax.Array) -> jax.Array:
      if not x.is_fully_addressable:
        x = multihost_utils.process_allgather(x, tiled=True)
      return jax.device_put(x, given.sharding)
    result = jax.tree.map(back, engine.params, params)
    return RunResult(result, engine.rows, summary, engine.model_state)
  finally:
    engine.close()


def _spec_dict(spec: state_lib.RunSpec) -> dict[str, Any]:
  """A ``RunSpec`` as config.json records it (standard JSON: null for "none")."""
  out = dataclasses.asdict(spec)
  out["method"] = spec.method.name
  if callable(spec.fragment_layout):  # its code, not its address: a resume matches
    out["fragment_layout"] = checks.function_fingerprint(spec.fragment_layout)
  out["comm"] = {"latency": spec.comm.latency,
                 "bandwidth": None if math.isinf(spec.comm.bandwidth) else spec.comm.bandwidth,
                 "ddp_overlap": spec.comm.ddp_overlap}
  if math.isinf(spec.syncer.timeout):
    out["syncer"]["timeout"] = None
  out["syncer"].pop("aggregate")  # by its repr; the default absent, as before it existed
  if spec.syncer.aggregate != aggregate_lib.Mean():
    out["syncer"]["aggregate"] = repr(spec.syncer.aggregate)
  out["membership"] = [[w, leave, None if math.isinf(back) else back]
                       for w, leave, back in spec.membership.absences]
  return out


def _spec_json(engine: engine_lib.Engine, settings: dict[str, Any]) -> str:
  """The run's settings as JSON (a workdir's config.json): what a resume must match, with
  the layout's version (``heloco_jax/rundir/workdir.py``)."""
  spec = _spec_dict(engine.spec)
  spec["options"] = settings  # JSON as far as it goes; other values by their repr
  spec["params"] = [list(np.shape(x)) for x in jax.tree.leaves(engine.params)]
  spec[workdir_lib.SCHEMA_KEY] = workdir_lib.SCHEMA_VERSION
  return json.dumps(spec, indent=2, sort_keys=True, default=str) + "\n"


def _defaults_json(engine: engine_lib.Engine) -> str:
  """What a key absent from an older config.json of the API ran with: its ``RunSpec``
  field's default, or ``workdir_lib.ADDED``'s (docs/DESIGN.md, "Files a run writes")."""
  defaulted = workdir_lib.spec_defaults(engine.spec)
  recorded = _spec_dict(dataclasses.replace(engine.spec, **defaulted))
  defaults = {key: recorded[key] for key in defaulted}
  defaults.update(workdir_lib.ADDED)
  return json.dumps(defaults, sort_keys=True, default=str)
