"""The CLI's defaults around the engine: TinyGPT, the byte-level data, the evaluator.

``Simulation(config)`` builds one run of a config of ``heloco_jax/configs``
(docs/DESIGN.md, "Command line"): the model of ``config.model``, the data of
``config.data`` (K grain iterators), the held-out evaluation, the method's
inner and outer optimizers and the runtime of ``config.runtime``, and hands
them to the engine (``heloco_jax.runtime.engine.Engine``), which knows none
of them. Its budgets and rows count tokens (``batch_size`` × ``context`` per
inner step).
"""

from __future__ import annotations

import asyncio
import functools
import math
import re
from typing import Any, Callable, Optional

import ml_collections

from heloco_jax import clock, data as data_lib, evaluate, inner as inner_lib, methods
from heloco_jax import model as model_lib
from heloco_jax.runtime import devices as devices_lib, engine, simulated, state

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


def spec_from(config: ml_collections.ConfigDict) -> state.RunSpec:
  """The engine's ``RunSpec`` of a run config (budgets and cadence in tokens)."""
  fault = config.fault
  return state.RunSpec(
      method=methods.get(config.method), num_workers=config.num_workers,
      inner_steps=config.inner_steps,
      seconds_per_step=tuple(clock.seconds_per_step(config.speeds, config.num_workers)),
      jitter=config.jitter,
      comm=clock.CommModel(config.comm.latency, config.comm.bandwidth or math.inf,
                           config.comm.ddp_overlap),
      dylu=config.dylu, grace_window=config.grace_window,
      palsgd_warmup_steps=config.palsgd_warmup_steps,
      budget=state.Budget(config.budget.tokens, config.budget.sim_seconds),
      eval_every=config.eval_every_tokens,
      units_per_step=config.batch_size * config.model.context, unit="tokens",
      checkpoint_every=config.checkpoint_every, metrics_fetch_every=config.metrics_fetch_every,
      rejection_limit=config.rejection_limit, palsgd_coins=config.inner.palsgd_coins,
      seed=config.seed,
      fault=state.Fault(fault.worker, fault.arrival, fault.value, fault.kill_worker))


def make_inner_loop(config: ml_collections.ConfigDict, loss_fn: Callable[..., Any]
                    ) -> inner_lib.InnerLoop:
  """The workers' inner loop: the method's default inner optimizer from ``config.inner``."""
  method = methods.get(config.method)
  reset = (method.reset_optimizer if config.inner.reset_optimizer < 0
           else bool(config.inner.reset_optimizer))
  return inner_lib.InnerLoop(loss_fn, method.make_inner(inner_lib.config_from(config.inner)),
                             reset)


def make_runtime(config: ml_collections.ConfigDict, inner: inner_lib.InnerLoop) -> Any:
  """The runtime of ``config.runtime`` (its ``devices.*`` / ``ray.*`` keys)."""
  if config.runtime == "devices":
    groups = devices_lib.group_devices(
        config.num_workers, config.batch_size, config.devices.group_sizes,
        config.devices.server, config.devices.slowdown,
        synchronous=methods.get(config.method).synchrony == "round")
    return devices_lib.DeviceRuntime(inner, groups)
  if config.runtime == "ray":
    from heloco_jax.runtime import ray  # pylint: disable=g-import-not-at-top
    options = ray.RayOptions(
        address=config.ray.address, num_cpus=config.ray.num_cpus,
        cpus_per_worker=config.ray.cpus_per_worker, gpus_per_worker=config.ray.gpus_per_worker,
        server_gpus=config.ray.server_gpus, log_to_driver=config.ray.log_to_driver,
        max_restarts=config.ray.max_restarts,
        slowdown=devices_lib.slowdown_factors(config.devices.slowdown, config.num_workers),
        batch_size=config.batch_size)
    return ray.RayRuntime(inner, config.num_workers, options)
  return simulated.SimulatedRuntime(inner)


class Simulation(engine.Engine):
  """One run of ``config`` (see ``heloco_jax/configs/default.py``).

  Args:
    config: the run's ``ml_collections.ConfigDict``.
    dataset: a ``heloco_jax.data.Data`` to use instead of building one from
      ``config.data`` (tests share one across runs).
  """

  def __init__(self, config: ml_collections.ConfigDict,
               dataset: Optional[data_lib.Data] = None):
    self.config = config
    method = methods.get(config.method)
    self.data = dataset or make_dataset(config)
    graphdef, params = model_lib.init(
        model_lib.config_from(config.model, self.data.vocab_size), config.seed)
    evaluator = evaluate.Evaluator(functools.partial(model_lib.token_losses, graphdef),
                                   self.data.validation_tokens,
                                   self.data.validation_language_ids, self.data.languages)
    inner = make_inner_loop(config, functools.partial(model_lib.loss, graphdef))
    option = None if config.lookahead_dispatch < 0 else bool(config.lookahead_dispatch)
    super().__init__(
        spec_from(config), make_runtime(config, inner), params,
        [self.data.worker_iterator(i) for i in range(config.num_workers)],
        outer_tx=method.make_outer(config.num_workers, config.outer),
        eval_fn=evaluator.as_metrics, lookahead=method.lookahead_dispatch(option),
        arrival_weight=method.arrival_weight(config.num_workers, config.outer.weighting))


def simulate(config: ml_collections.ConfigDict, dataset: Optional[data_lib.Data] = None,
             on_row: Optional[Callable[[Row], None]] = None) -> tuple[dict[str, Any], list[Row]]:
  """Runs ``config``; returns (summary, metrics rows).

  Inside a running event loop (a Jupyter kernel) ``asyncio.run`` is not
  allowed: there, ``simulation = Simulation(config)``, ``summary = await
  simulation.run()`` and ``simulation.rows`` do the same.
  """
  engine.require_no_event_loop(
      "simulate()", "`simulation = Simulation(config); summary = await simulation.run()` and "
      "`simulation.rows`")
  simulation = Simulation(config, dataset)
  try:
    summary = asyncio.run(simulation.run(on_row))
  finally:
    simulation.close()
  return summary, simulation.rows
