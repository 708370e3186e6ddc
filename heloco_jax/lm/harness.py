"""The CLI's defaults around the engine: TinyGPT, the data, the evaluator, and its arguments.

A run config of ``heloco_jax/cli/configs`` (docs/DESIGN.md, "Command line")
becomes ``hj.make_engine``'s arguments here: ``default_problem`` builds the
model of ``config.model``, the data of ``config.data`` (K grain iterators)
and the held-out evaluation, and ``engine_options`` the rest (the method's
inner optimizer of ``config.inner``, its outer options of ``config.outer``,
the runtime, budgets and cadence in tokens: ``batch_size`` × ``context`` per
inner step). The engine knows none of them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Callable, Optional

import jax
import ml_collections
import numpy as np

from heloco_jax.comm import compress, cost, fragments
from heloco_jax.training import aggregate as aggregate_lib
from heloco_jax.comm import syncer as syncer_lib
from heloco_jax.lm import data as data_lib
from heloco_jax.lm import evaluate
from heloco_jax.lm import model as model_lib
from heloco_jax.runtime import clocks, factories, faults
from heloco_jax.training import inner as inner_lib
from heloco_jax.training import membership as membership_lib
from heloco_jax.training import methods, sharding

Row = dict[str, Any]


def _languages(value: Any) -> Optional[list[str]]:
  if not value:
    return None
  return [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value)


# make_data's arguments -> the config keys they come from (for its error messages).
_DATA_KEYS = {"source": "data.source", "path": "data.path", "languages": "data.languages",
              "partition": "data.partition", "dirichlet_alpha": "data.dirichlet_alpha",
              "num_workers": "num_workers", "context": "model.context",
              "batch_size": "batch_size",
              "val_sequences_per_language": "data.val_sequences_per_language",
              "max_bytes_per_language": "data.max_bytes_per_language",
              "tokenizer": "data.tokenizer"}


def make_dataset(config: ml_collections.ConfigDict) -> data_lib.Data:
  """The run's data (languages, per-worker iterators, validation set) from ``config.data``.

  Raises:
    ValueError: the data cannot be built; the message names config keys
      (``config.data.languages=...``), not ``make_data``'s arguments.
  """
  try:
    return data_lib.make_data(
        source=config.data.source, path=config.data.path or None,
        languages=_languages(config.data.languages), partition=config.data.partition,
        dirichlet_alpha=config.data.dirichlet_alpha, num_workers=config.num_workers,
        context=config.model.context, batch_size=config.batch_size,
        val_sequences_per_language=config.data.val_sequences_per_language, seed=config.seed,
        max_bytes_per_language=config.data.max_bytes_per_language or None,
        tokenizer_path=None if config.data.tokenizer == "bytes" else config.data.tokenizer)
  except ValueError as error:
    message = re.sub(r"^make_data: ", "", str(error))
    # `name=value`, and bare names that are identifiers (not words such as "languages")
    assigned = "|".join(_DATA_KEYS)
    bare = "|".join(name for name in _DATA_KEYS if "_" in name)
    message = re.sub(rf"(?<![\w.])(?:({assigned})(?==)|({bare})\b)",
                     lambda m: "config." + _DATA_KEYS[m.group(1) or m.group(2)], message)
    raise ValueError(message) from None


def runtime_factory(config: ml_collections.ConfigDict) -> factories.RuntimeFactory:
  """The ``runtime=`` of ``config.runtime`` with its ``devices.*`` / ``ray.*`` keys."""
  def ray(c):
    from heloco_jax.runtime import devices  # pylint: disable=g-import-not-at-top
    return factories.ray_runtime(
        address=c.ray.address, num_cpus=c.ray.num_cpus, cpus_per_worker=c.ray.cpus_per_worker,
        gpus_per_worker=c.ray.gpus_per_worker, server_gpus=c.ray.server_gpus,
        log_to_driver=c.ray.log_to_driver, max_restarts=c.ray.max_restarts,
        replacements=c.ray.replacements, devices_per_worker=c.ray.devices_per_worker,
        workers_per_actor=c.ray.workers_per_actor, spares=c.ray.spares,
        slowdown=devices.slowdown_factors(c.devices.slowdown, c.num_workers),
        batch_size=c.batch_size)
  return {
      "simulated": lambda c: factories.simulated_runtime(),
      "devices": lambda c: factories.devices_runtime(
          c.batch_size, c.devices.group_sizes, c.devices.server, c.devices.slowdown),
      "ray": ray,
  }[config.runtime](config)


def deterministic(config: ml_collections.ConfigDict) -> bool:
  """``config.deterministic`` resolved, with no JAX calls. Unset: on where the runtime's clock
  is simulated and the model computes in float32; off in bfloat16, where XLA's deterministic
  GPU ops cost 2.5-2.7x on an H200 and an H100 (docs/DESIGN.md, "Determinism"). The flag
  acts on GPUs only: CPU and TPU runs replay bit for bit either way."""
  if config.deterministic is not None:
    return bool(config.deterministic)
  return (runtime_factory(config).simulated_clock
          and config.model.get("compute_dtype", "float32") == "float32")


@dataclasses.dataclass
class Problem:
  """The CLI's default problem: TinyGPT on ``config.data``, evaluated on its held-out set.

  Attributes:
    data: the dataset (languages, per-worker iterators, validation set).
    loss_fn: TinyGPT's mean next-token loss.
    params: the initial parameters.
    eval_fn: the held-out evaluation (``val_loss`` and one per language).
  """
  data: data_lib.Data
  loss_fn: Callable[..., Any]
  params: Any
  eval_fn: Callable[[Any], Any]


def default_problem(config: ml_collections.ConfigDict,
                    dataset: Optional[data_lib.Data] = None) -> Problem:
  """TinyGPT of ``config.model`` on the data of ``config.data`` (or ``dataset``)."""
  data = dataset or make_dataset(config)
  graphdef, params = model_lib.init(model_lib.config_from(config.model, data.vocab_size),
                                    config.seed)
  if config.model.sharding != "none":
    params = _shard(params, config)
  evaluator = evaluate.Evaluator(functools.partial(model_lib.token_losses, graphdef),
                                 data.validation_tokens, data.validation_language_ids,
                                 data.languages)
  return Problem(data, functools.partial(model_lib.loss, graphdef), params, evaluator.as_metrics)


def _shard(params: Any, config: ml_collections.ConfigDict) -> Any:
  """θ placed as ``model.sharding`` says, over the devices one worker's θ spans."""
  devices = runtime_factory(config).worker_devices(config.num_workers)
  if config.model.sharding == "fsdp":
    return sharding.put_fsdp(params, devices)
  tp = config.model.tensor_parallel
  if len(devices) % tp:
    raise ValueError(f"config.model.tensor_parallel={tp} is not allowed; allowed: a divisor "
                     f"of the {len(devices)} device(s) θ spans")
  mesh = jax.sharding.Mesh(np.array(devices).reshape(len(devices) // tp, tp), ("fsdp", "tp"))
  fsdp = mesh.shape["fsdp"]
  specs = sharding.specs_by_path(params, model_lib.TENSOR_PARALLEL_RULES, mesh,
                                 default=lambda leaf: sharding.fsdp_specs(leaf, "fsdp", fsdp))
  return sharding.put(params, mesh, specs)


def inner_config(inner: ml_collections.ConfigDict) -> inner_lib.InnerConfig:
  """The ``InnerConfig`` of a run config's ``inner`` section (cli/configs/default.py)."""
  return inner_lib.InnerConfig(
      learning_rate=inner.learning_rate, warmup_steps=inner.warmup_steps,
      total_steps=inner.total_steps, min_learning_rate_ratio=inner.min_learning_rate_ratio,
      weight_decay=inner.weight_decay, grad_clip=inner.grad_clip,
      pseudo_sync_prob=inner.pseudo_sync_prob, pseudo_sync_rate=inner.pseudo_sync_rate)


def syncer(config: ml_collections.ConfigDict) -> syncer_lib.Syncer:
  """The syncer policy of a run config's ``syncer`` keys."""
  c = config.syncer
  return syncer_lib.Syncer(quorum=c.quorum, timeout=math.inf if c.timeout is None else c.timeout,
                           grace_window=c.grace_window, adaptive_grace=c.adaptive_grace,
                           weights=c.weights, aggregate=aggregate_lib.parse(c.aggregate))


def membership(config: ml_collections.ConfigDict) -> Optional[membership_lib.Membership]:
  """The failure schedule of a run config's ``chaos`` keys (None: no failures):
  ``chaos.schedule``'s absences and, with ``chaos.rate`` > 0, seeded random ones of every
  worker up to the time budget (or ten times the time the workers need for the token budget
  at their paces)."""
  c = config.chaos
  schedule = membership_lib.Membership.parse(c.schedule)
  if c.rate == 0:
    return schedule if schedule.absences else None
  seconds = np.asarray(clocks.seconds_per_step(config.speeds, config.num_workers))
  horizon = config.budget.sim_seconds or 10 * config.budget.tokens / (
      config.batch_size * config.model.context * np.sum(1 / seconds))
  drawn = membership_lib.Membership.random(config.num_workers, rate=c.rate, downtime=c.downtime,
                            horizon=float(horizon), seed=config.seed)
  both = membership_lib.Membership(schedule.absences + drawn.absences)
  if schedule.absences and "overlap" in (both.refusal(config.num_workers) or ""):
    raise ValueError(f"chaos.rate={c.rate!r}: its drawn failures overlap chaos.schedule's "
                     f"({both.refusal(config.num_workers)}); allowed: chaos.rate=0 with a "
                     "schedule, or a schedule of other workers than those that fail at random")
  return both


# Outer keys added since CLI workdirs were first written, passed on only away from their
# default: a default run's method_options (an older workdir's config.json records them) stay
# as they were.
_ADDED_OUTER_KEYS = {"merge_order": "merge_then_correct"}


def outer_options(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The keys of ``config.outer`` the method takes (``Method.outer_keys``); the others are
  other methods' (unset keys: the method's defaults)."""
  return {key: config.outer[key] for key in methods.get(config.method).outer_keys
          if key not in _ADDED_OUTER_KEYS or config.outer[key] != _ADDED_OUTER_KEYS[key]}


# ``Method.run_keys`` -> their config keys (``method_options``; the CLI's validation refuses
# another method's set away from its default).
RUN_KEYS = {"lookahead_dispatch": "lookahead_dispatch", "dylu": "dylu",
            "coins": "inner.palsgd_coins", "warmup_steps": "palsgd_warmup_steps"}


def config_value(config: ml_collections.ConfigDict, name: str) -> Any:
  """The value of the dotted key ``name`` (e.g. ``inner.palsgd_coins``) of ``config``."""
  node = config
  for part in name.split("."):
    node = node[part]
  return node


def method_options(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """``hj.make_engine``'s ``method_options``: ``config.outer``'s keys of the method and
  the run keys it takes (``Method.run_keys``, their config keys ``RUN_KEYS``)."""
  return {**outer_options(config),
          **{key: config_value(config, RUN_KEYS[key])
             for key in methods.get(config.method).run_keys}}


def engine_options(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """``hj.make_engine``'s keyword arguments of a run config, budgets in tokens; each config
  group is one of its objects (``budget`` → ``hj.Budget``, ``streaming`` →
  ``hj.Streaming``, ``syncer`` → ``hj.Syncer``, ``chaos`` → ``hj.Membership`` and, for
  ``chaos.faulty``, the runtime wrapped by ``runtime.faults.faulty``, ``comm`` →
  ``hj.CommModel``, ``compression`` → a compressor)."""
  method = methods.get(config.method)
  from heloco_jax import api  # pylint: disable=g-import-not-at-top
  return dict(
      method=config.method,
      inner_tx=method.make_inner(inner_config(config.inner)),
      inner_steps=config.inner_steps, speeds=config.speeds,
      budget=api.Budget(tokens=config.budget.tokens or None,
                        sim_seconds=config.budget.sim_seconds or None,
                        tokens_per_step=config.batch_size * config.model.context,
                        eval_every_tokens=config.budget.eval_every_tokens or None),
      seed=config.seed,
      runtime=faults.faulty(runtime_factory(config), faults.Faults.parse(config.chaos.faulty)),
      method_options=method_options(config),
      reset_optimizer=config.inner.reset_optimizer,
      syncer=syncer(config), membership=membership(config),
      jitter=config.jitter,
      comm=cost.CommModel(config.comm.latency,
                           math.inf if config.comm.bandwidth is None else config.comm.bandwidth,
                           config.comm.ddp_overlap),
      metrics_fetch_every=config.metrics_fetch_every,
      rejection_limit=config.rejection_limit,
      deterministic=deterministic(config),
      compress=compress.Compression(compressor(config), download_compressor(config)),
      streaming=fragments.Streaming(config.streaming.fragments, config.streaming.layout,
                                    config.streaming.overlap_steps, config.streaming.alpha))


def download_compressor(config: ml_collections.ConfigDict) -> Optional[compress.Compressor]:
  """θ's downloads' compressor (``compression.download``): Δ's kind, block and fraction,
  without error feedback (the server's x̂ carries what a message drops)."""
  c = config.compression
  if not c.download:
    return None
  return compress.by_name(c.kind, block=c.block, fraction=c.fraction)


def compressor(config: ml_collections.ConfigDict) -> Optional[compress.Compressor]:
  """The workers' compressor of ``config.compression`` (None for kind "none" without error
  feedback: Δ is sent as it is, today's runs bit for bit)."""
  c = config.compression
  if c.kind == "none" and not c.error_feedback:
    return None
  return compress.by_name(c.kind, block=c.block, fraction=c.fraction,
                          error_feedback=c.error_feedback)


def engine_of_config(config: ml_collections.ConfigDict, dataset: Optional[data_lib.Data] = None,
                     workdir: Any = None, **overrides: Any) -> tuple[Any, Problem]:
  """(``hj.make_engine`` of ``config``'s default problem, the problem); ``overrides``
  replace keyword arguments (e.g. a test's ``runtime``). ``workdir`` (a path or an
  ``hj.Workdir``) takes ``config.checkpoint.every`` and ``config.checkpoint.keep``."""
  from heloco_jax import api  # pylint: disable=g-import-not-at-top
  if workdir is not None:
    workdir = dataclasses.replace(
        workdir if isinstance(workdir, api.Workdir) else api.Workdir(str(workdir)),
        checkpoint_every=config.checkpoint.every, keep_checkpoints=config.checkpoint.keep)
  problem = default_problem(config, dataset)
  options = {**engine_options(config), **overrides}
  engine = api.make_engine(problem.loss_fn, problem.params,
                           [problem.data.worker_iterator(i) for i in range(config.num_workers)],
                           eval_fn=problem.eval_fn, workdir=workdir, **options)
  return engine, problem
