"""Checks a run's config before any work (DESIGN.md, "Command line").

``validate(config)`` raises ``ConfigError`` whose message is one line naming
the key, its value and what is allowed:
``config.num_workers=0 is not allowed; allowed: an integer >= 1.``
Keys whose rules live with the code that uses them (model sizes, the inner
optimizer, the outer rules' arguments, speeds) are checked by building those
objects and re-labelling their errors with the config key.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from typing import Any

import ml_collections

from heloco_jax import clock, data, inner, model, writers
from heloco_jax.runtime import devices
from heloco_jax.runtime.state import PALSGD_COINS
from heloco_jax.methods import METHODS
from heloco_jax.outer import _validation
from heloco_jax.outer.correction import ROTATE_SCHEDULES, SCOPES
from heloco_jax.outer.heloco import WEIGHT_ORDERS
from heloco_jax.outer.weighting import WEIGHTINGS

RUNTIMES_AVAILABLE = ("simulated", "devices", "ray")
# Arguments of the outer factories whose config key differs from their name.
_OUTER_KEYS = {"c": "dn_c"}

# The allowed values of every config key, as `heloco-jax train --help` shows them
# (heloco_jax.configs.help). CHOICES are the very tuples the checks below test
# against; ALLOWED says in words what the other checks require
# (tests/test_config_help.py probes it against `validate`).
CHOICES: dict[str, tuple[Any, ...]] = {
    "method": tuple(METHODS),
    "speeds": tuple(clock.PRESETS),
    "runtime": RUNTIMES_AVAILABLE,
    "lookahead_dispatch": (-1, 0, 1),
    "deterministic": (-1, 0, 1),
    "data.source": tuple(data.SOURCES),
    "data.partition": tuple(data.PARTITIONS),
    "inner.reset_optimizer": (-1, 0, 1),
    "outer.weighting": WEIGHTINGS,
    "outer.rotate_schedule": ROTATE_SCHEDULES,
    "outer.weight_order": WEIGHT_ORDERS,
    "outer.scope": SCOPES,
    "fault.value": ("nan", "inf"),
    "inner.palsgd_coins": PALSGD_COINS,
    "model.compute_dtype": model.COMPUTE_DTYPES,
}


def _one_of(key: str) -> str:
  return "one of: " + ", ".join(str(c) for c in CHOICES[key])


ALLOWED: dict[str, str] = {
    "method": _one_of("method"),
    "seed": "an integer >= 0",
    "num_workers": "an integer >= 1",
    "inner_steps": "an integer >= 1",
    "speeds": _one_of("speeds") + "; or a list of num_workers seconds per step (> 0)",
    "jitter": "a number in [0, 1)",
    "batch_size": "an integer >= 1 (runtime=devices: a multiple of every group's size)",
    "eval_every_tokens": "an integer >= 0",
    "metrics_fetch_every": "an integer >= 1",
    "runtime": _one_of("runtime") + " (ray: asynchronous methods only)",
    "checkpoint_every": "an integer >= 0",
    "keep_checkpoints": "an integer >= 1",
    "grace_window": "a number >= 0",
    "dylu": "True or False",
    "quiet": "True or False",
    "writers": "'' (jsonl, plus tensorboard when tensorboardX is installed) or a "
               "comma-separated list of jsonl (required), tensorboard",
    "lookahead_dispatch": _one_of("lookahead_dispatch") + " (heloco: not 0; only mla, heloco: 1)",
    "palsgd_warmup_steps": "an integer >= -1",
    "rejection_limit": "an integer >= 0",
    "deterministic": _one_of("deterministic"),
    "budget.tokens": "an integer >= 0 (budget.tokens or budget.sim_seconds must be > 0)",
    "budget.sim_seconds": "a number >= 0",
    "model.d_model": "an integer >= 1",
    "model.num_layers": "an integer >= 1",
    "model.num_heads": "an integer >= 1 that divides model.d_model",
    "model.context": "an integer >= 1",
    "model.compute_dtype": _one_of("model.compute_dtype"),
    "data.source": _one_of("data.source"),
    "data.path": "a directory (text_dir, jsonl) or a tensorflow-datasets name (tfds)",
    "data.languages": "comma-separated language names, or '' (all)",
    "data.partition": _one_of("data.partition"),
    "data.dirichlet_alpha": "a number > 0",
    "data.val_sequences_per_language": "an integer >= 1",
    "data.max_bytes_per_language": "an integer >= 0",
    "data.tokenizer": "'bytes', or the path of a tokenizer.json (heloco-jax corpus bpe)",
    "inner.learning_rate": "a number > 0",
    "inner.warmup_steps": "an integer >= 0",
    "inner.total_steps": "an integer > inner.warmup_steps",
    "inner.min_learning_rate_ratio": "a number in [0, 1]",
    "inner.weight_decay": "a number >= 0",
    "inner.grad_clip": "a number >= 0",
    "inner.reset_optimizer": _one_of("inner.reset_optimizer"),
    "inner.palsgd_coins": _one_of("inner.palsgd_coins"),
    "inner.pseudo_sync_prob": "a number in [0, 1)",
    "inner.pseudo_sync_rate": ("a number >= 0; palsgd: pseudo_sync_rate·learning_rate/"
                               "pseudo_sync_prob <= 1"),
    "outer.learning_rate": "a number >= 0",
    "outer.momentum": "a number in [0, 1)",
    "outer.weighting": _one_of("outer.weighting"),
    "outer.buffer_size": "an integer >= 0",
    "outer.dn_c": "a number in [0, 1/N], N the buffer size",
    "outer.keep_threshold": "a number in [-1, 1]",
    "outer.bad_threshold": "a number < outer.keep_threshold (with rotate_schedule=normalized)",
    "outer.shrink_strength": "a number >= 0",
    "outer.max_shrink": "a number in [0, 1]",
    "outer.rotate_strength": "a number >= 0",
    "outer.confidence_scale": "a number >= 0",
    "outer.rotate_schedule": _one_of("outer.rotate_schedule"),
    "outer.weight_order": _one_of("outer.weight_order"),
    "outer.scope": _one_of("outer.scope"),
    "fault.worker": "-1 (off) or a worker in [0, num_workers); not with ddp",
    "fault.arrival": "an integer >= 1",
    "fault.value": _one_of("fault.value"),
    "fault.kill_worker": "-1 (off), or with runtime=ray a worker in [0, num_workers)",
    "devices.group_sizes": "'' or num_workers comma-separated integers >= 1",
    "devices.server": "an index into jax.devices()",
    "devices.slowdown": "'' or num_workers comma-separated numbers >= 1",
    "distributed.coordinator": "'', 'auto' or HOST:PORT (synchronous methods, runtime=devices)",
    "distributed.num_processes": "an integer >= 1 (with HOST:PORT)",
    "distributed.process_id": "an integer in [0, distributed.num_processes) (with HOST:PORT)",
    "ray.address": "'', 'auto' or HOST:PORT",
    "ray.num_cpus": "a number >= 0",
    "ray.cpus_per_worker": "a number >= 0",
    "ray.gpus_per_worker": "a number >= 0",
    "ray.server_gpus": "a number >= 0",
    "ray.log_to_driver": "True or False",
    "ray.max_restarts": "an integer >= 0",
    "comm.latency": "a number >= 0",
    "comm.bandwidth": "a number >= 0",
    "comm.ddp_overlap": "a number in [0, 1)",
}


class ConfigError(ValueError):
  """An invalid config value; the message names the key, the value and what is allowed."""


def _fail(key: str, value: Any, allowed: str) -> None:
  raise ConfigError(f"config.{key}={value!r} is not allowed; allowed: {allowed}.")


def _checked(check, key: str, *args, **kwargs) -> None:
  """Runs one of the shared argument checks on ``config.<key>``, as a ``ConfigError``."""
  try:
    check(None, f"config.{key}", *args, **kwargs)
  except ValueError as error:
    raise ConfigError(str(error)) from None


_integer = functools.partial(_checked, _validation.check_int)
_number = functools.partial(_checked, _validation.check_range)
_choice = functools.partial(_checked, _validation.check_choice)


def _relabel(error: ValueError, prefix: str, rename: dict[str, str] | None = None) -> ConfigError:
  """'fn: name=value is not allowed; ...' or 'inner.name=...' → 'config.<prefix>name=...'."""
  message = str(error)
  match = re.match(r"^(?:[\w.]+: )?(?:[a-z_]+\.)?([a-z_]+)=(.*)$", message, flags=re.S)
  if not match:
    return ConfigError(f"config.{prefix}: {message}")
  name = (rename or {}).get(match.group(1), match.group(1))
  return ConfigError(f"config.{prefix}{name}={match.group(2)}")


def _validate_ray(config: ml_collections.ConfigDict, method: Any) -> None:
  if method.synchrony != "async":
    _fail("runtime", "ray", f"'simulated' or 'devices' with method={config.method!r}; "
          "runtime='ray' runs the asynchronous methods (async_nesterov, delayed_nesterov, mla, "
          "heloco). Synchronous methods run across processes with jax.distributed: "
          "runtime='devices' and the distributed.* keys")
  for key in ("num_cpus", "cpus_per_worker", "gpus_per_worker", "server_gpus"):
    _number(f"ray.{key}", config.ray[key], 0.0)
  _integer("ray.max_restarts", config.ray.max_restarts, 0)
  try:
    devices.slowdown_factors(config.devices.slowdown, config.num_workers)
  except devices.DeviceConfigError as error:
    raise ConfigError(str(error)) from None
  if importlib.util.find_spec("ray") is None:
    _fail("runtime", "ray", "'simulated' or 'devices': Ray is not installed "
          "(pip install 'heloco-jax[ray]')")


def validate_distributed(config: ml_collections.ConfigDict) -> None:
  """The ``distributed.*`` keys; runs before ``jax.distributed.initialize`` (no JAX calls)."""
  dist = config.distributed
  if not dist.coordinator:
    return
  if config.runtime != "devices" or METHODS[config.method].synchrony == "async":
    _fail("distributed.coordinator", dist.coordinator, "'' (one process) with "
          f"runtime={config.runtime!r} and method={config.method!r}; several processes run "
          "the synchronous methods (ddp, local_sgd, diloco, palsgd) on runtime='devices'")
  if config.checkpoint_every:
    _fail("checkpoint_every", config.checkpoint_every, "0 with distributed.coordinator set "
          "(checkpoints of multi-process runs are not supported yet)")
  if dist.coordinator != "auto":
    if not re.fullmatch(r"[\w.\-\[\]:]+:\d+", dist.coordinator):
      _fail("distributed.coordinator", dist.coordinator, "'', 'auto' or HOST:PORT")
    _integer("distributed.num_processes", dist.num_processes, 1)
    _integer("distributed.process_id", dist.process_id, 0)
    if dist.process_id >= dist.num_processes:
      _fail("distributed.process_id", dist.process_id,
            f"0 to {dist.num_processes - 1} (distributed.num_processes - 1)")


def deterministic(config: ml_collections.ConfigDict) -> bool:
  """``config.deterministic`` resolved (-1: on for runtime=simulated); no JAX calls."""
  _choice("deterministic", config.deterministic, CHOICES["deterministic"])
  return config.runtime == "simulated" if config.deterministic < 0 else bool(config.deterministic)


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ``ConfigError`` for the first invalid value of ``config``."""
  _choice("method", config.method, CHOICES["method"])
  method = METHODS[config.method]
  _integer("seed", config.seed, 0)
  _integer("num_workers", config.num_workers, 1)
  _integer("inner_steps", config.inner_steps, 1)
  try:
    clock.seconds_per_step(config.speeds, config.num_workers)
  except ValueError as error:
    raise ConfigError(f"config.{error}") from None
  _number("jitter", config.jitter, 0.0, 1.0, high_open=True)
  _integer("batch_size", config.batch_size, 1)
  _integer("eval_every_tokens", config.eval_every_tokens, 0)
  _integer("metrics_fetch_every", config.metrics_fetch_every, 1)
  _integer("rejection_limit", config.rejection_limit, 0)
  _choice("deterministic", config.deterministic, CHOICES["deterministic"])
  try:
    writers.parse(config.writers)
  except ValueError as error:
    raise ConfigError(f"config.{error}") from None
  validate_distributed(config)
  if config.runtime not in CHOICES["runtime"]:
    _fail("runtime", config.runtime, "'simulated', 'devices' or 'ray'")
  if config.runtime == "devices":
    try:
      devices.group_devices(config.num_workers, config.batch_size, config.devices.group_sizes,
                            config.devices.server, config.devices.slowdown,
                            synchronous=method.synchrony == "round")
    except devices.DeviceConfigError as error:
      raise ConfigError(str(error)) from None
  if config.runtime == "ray":
    _validate_ray(config, method)
  _integer("checkpoint_every", config.checkpoint_every, 0)
  _integer("keep_checkpoints", config.keep_checkpoints, 1)
  _number("grace_window", config.grace_window, 0.0)
  if not isinstance(config.dylu, bool):
    _fail("dylu", config.dylu, "True or False")
  _choice("lookahead_dispatch", config.lookahead_dispatch, CHOICES["lookahead_dispatch"])
  if method.lookahead == "always" and config.lookahead_dispatch == 0:
    _fail("lookahead_dispatch", 0, f"-1 or 1 with method={config.method!r} (it always "
          "dispatches from the look-ahead point)")
  if method.lookahead == "never" and config.lookahead_dispatch == 1:
    _fail("lookahead_dispatch", 1, f"-1 or 0 with method={config.method!r} (look-ahead "
          "dispatch needs an MLA or HeLoCo momentum)")
  _integer("palsgd_warmup_steps", config.palsgd_warmup_steps, -1)

  _integer("budget.tokens", config.budget.tokens, 0)
  _number("budget.sim_seconds", config.budget.sim_seconds, 0.0)
  if config.budget.tokens == 0 and config.budget.sim_seconds == 0:
    _fail("budget.tokens", 0, "a token budget > 0, or a budget.sim_seconds > 0 (a run needs "
          "an end)")

  try:
    model.config_from(config.model)
  except ValueError as error:
    raise ConfigError(f"config.{error}") from None

  _choice("data.source", config.data.source, CHOICES["data.source"])
  _choice("data.partition", config.data.partition, CHOICES["data.partition"])
  _number("data.dirichlet_alpha", config.data.dirichlet_alpha, 0.0, low_open=True)
  _integer("data.val_sequences_per_language", config.data.val_sequences_per_language, 1)
  _integer("data.max_bytes_per_language", config.data.max_bytes_per_language, 0)
  if config.data.tokenizer != "bytes" and not os.path.exists(str(config.data.tokenizer)):
    _fail("data.tokenizer", config.data.tokenizer, ALLOWED["data.tokenizer"])
  if config.data.source in ("text_dir", "jsonl"):
    if not config.data.path or not os.path.isdir(config.data.path):
      _fail("data.path", config.data.path, f"an existing directory for data.source="
            f"{config.data.source!r} (e.g. the output of `heloco-jax corpus debian_docs`)")
  if config.data.source == "tfds" and not config.data.path:
    _fail("data.path", config.data.path, "a tensorflow-datasets name for data.source='tfds'")

  _choice("inner.palsgd_coins", config.inner.palsgd_coins, CHOICES["inner.palsgd_coins"])
  _choice("inner.reset_optimizer", config.inner.reset_optimizer,
          CHOICES["inner.reset_optimizer"])
  try:
    inner_config = inner.config_from(config.inner)
    if method.inner == "palsgd":  # only PALSGD pulls toward θ̃
      inner_config.check_pseudo_sync()
  except ValueError as error:
    raise _relabel(error, "inner.") from None

  _number("outer.learning_rate", config.outer.learning_rate, 0.0)
  _integer("outer.buffer_size", config.outer.buffer_size, 0)
  if method.outer is not None:
    try:
      method.make_outer(config.num_workers, config.outer)
    except ValueError as error:
      raise _relabel(error, "outer.", _OUTER_KEYS) from None

  _integer("fault.worker", config.fault.worker, -1)
  if config.fault.worker >= config.num_workers:
    _fail("fault.worker", config.fault.worker, f"-1 (off) or a worker in [0, "
          f"{config.num_workers})")
  _integer("fault.arrival", config.fault.arrival, 1)
  _choice("fault.value", config.fault.value, CHOICES["fault.value"])
  if config.fault.worker >= 0 and method.synchrony == "step":
    _fail("fault.worker", config.fault.worker, f"-1 with method={config.method!r} (DDP "
          "averages gradients every step: there is no pseudo-gradient to reject)")
  _integer("fault.kill_worker", config.fault.kill_worker, -1)
  if config.fault.kill_worker >= 0 and (config.runtime != "ray"
                                        or config.fault.kill_worker >= config.num_workers):
    _fail("fault.kill_worker", config.fault.kill_worker, f"-1 (off), or with runtime='ray' a "
          f"worker in [0, {config.num_workers})")

  _number("comm.latency", config.comm.latency, 0.0)
  _number("comm.bandwidth", config.comm.bandwidth, 0.0)
  if not 0 <= config.comm.ddp_overlap < 1:
    _fail("comm.ddp_overlap", config.comm.ddp_overlap, "a number in [0, 1)")
