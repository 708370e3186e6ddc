"""Checks a run's config before any work (DESIGN.md, "Command line").

``validate(config)`` raises ``ConfigError`` whose message is one line naming
the key, its value and what is allowed:
``config.num_workers=0 is not allowed; allowed: an integer >= 1.``
Every key's own rule is its ``schema.Key.check`` (the one table); the rules
here tie keys together. Keys whose rules live with the code that uses them
(model sizes, the inner optimizer, the outer rules' arguments, speeds,
devices) are checked by building those objects and re-labelling their errors
with the config key.
"""

from __future__ import annotations

import importlib.util
import os
import re
from typing import Any

import ml_collections

from heloco_jax.cli.configs import schema
from heloco_jax.training import aggregate as aggregate_lib
from heloco_jax.comm import fragments
from heloco_jax.lm import harness, model
from heloco_jax.rundir import writers
from heloco_jax.runtime import clocks, devices, faults
from heloco_jax.training.methods import METHODS

# Arguments of the outer factories whose config key differs from their name
# (training/methods.py: hj.delayed_nesterov's c, hj.cgad's b1, decay and cutoff).
_OUTER_KEYS = {"c": "dn_c", "b1": "momentum", "decay": "age_decay", "cutoff": "age_cutoff"}


class ConfigError(ValueError):
  """An invalid config value; the message names the key, the value and what is allowed."""


def _fail(key: str, value: Any, allowed: str) -> None:
  raise ConfigError(f"config.{key}={value!r} is not allowed; allowed: {allowed}.")


def check_keys(config: ml_collections.ConfigDict, names: Any = None) -> None:
  """Each key's own rule (``schema.KEYS``), for ``names`` (default: every key)."""
  for name in names or schema.BY_NAME:
    key = schema.BY_NAME[name]
    value = harness.config_value(config, name)
    if not key.check(value):
      _fail(name, value, key.check.allowed)


def _relabel(error: ValueError, prefix: str, rename: dict[str, str] | None = None) -> ConfigError:
  """'fn: name=value is not allowed; ...' or 'inner.name=...' → 'config.<prefix>name=...'."""
  message = str(error)
  match = re.match(r"^(?:[\w.]+: )?(?:[a-z_]+\.)?([a-z_]+)=(.*)$", message, flags=re.S)
  if not match:
    return ConfigError(f"config.{prefix}: {message}")
  name = (rename or {}).get(match.group(1), match.group(1))
  return ConfigError(f"config.{prefix}{name}={match.group(2)}")


def _runtime_factory(config: ml_collections.ConfigDict) -> Any:
  """The config's runtime factory (``harness.runtime_factory``), its errors as ConfigErrors."""
  try:
    return harness.runtime_factory(config)
  except ValueError as error:
    raise ConfigError(str(error)) from None


def _validate_devices(config: ml_collections.ConfigDict, method: Any) -> None:
  try:
    devices.group_devices(config.num_workers, config.batch_size, config.devices.group_sizes,
                          config.devices.server, config.devices.slowdown,
                          synchronous=method.synchrony != "async")
  except devices.DeviceConfigError as error:
    raise ConfigError(str(error)) from None


def _validate_ray(config: ml_collections.ConfigDict, method: Any) -> None:
  del config, method  # devices.slowdown was checked when the runtime factory was built
  if importlib.util.find_spec("ray") is None:
    _fail("runtime", "ray", "'simulated' or 'devices': Ray is not installed "
          "(pip install 'heloco-jax[ray]')")


# The keys of each runtime's own config section, checked when it is the config's runtime.
_RUNTIME_KEYS = {"simulated": lambda config, method: None, "devices": _validate_devices,
                 "ray": _validate_ray}


def validate_distributed(config: ml_collections.ConfigDict) -> None:
  """The ``distributed.*`` keys; runs before ``jax.distributed.initialize`` (no JAX calls)."""
  dist = config.distributed
  check_keys(config, ("method", "runtime", "distributed.coordinator",
                      "distributed.num_processes", "distributed.process_id",
                      "distributed.timeout"))
  if not dist.coordinator:
    return
  if (not _runtime_factory(config).multiprocess
      or METHODS[config.method].synchrony == "async"):
    _fail("distributed.coordinator", dist.coordinator, "'' (one process) with "
          f"runtime={config.runtime!r} and method={config.method!r}; several processes run "
          "the synchronous methods (ddp, local_sgd, diloco, palsgd) on runtime='devices'")
  if dist.coordinator != "auto":
    if not re.fullmatch(r"[\w.\-\[\]:]+:\d+", dist.coordinator):
      _fail("distributed.coordinator", dist.coordinator, "'', 'auto' or HOST:PORT")
    for name in ("num_processes", "process_id"):
      if dist[name] is None:
        _fail(f"distributed.{name}", None, "an integer, with distributed.coordinator=HOST:PORT")
    if dist.process_id >= dist.num_processes:
      _fail("distributed.process_id", dist.process_id,
            f"0 to {dist.num_processes - 1} (distributed.num_processes - 1)")


def deterministic(config: ml_collections.ConfigDict) -> bool:
  """``config.deterministic`` resolved (``harness.deterministic``); no JAX calls."""
  check_keys(config, ("deterministic", "runtime", "model.compute_dtype"))
  try:
    return harness.deterministic(config)
  except ValueError:  # a runtime option validate() names
    return False


def _check_fits(config: ml_collections.ConfigDict, model_config: Any) -> None:
  """Refuses a model whose float32 copies cannot fit in this machine's memory: θ, the outer
  state and each worker's parameters, AdamW moments and pseudo-gradient, at least (an
  estimate from the sizes alone, before anything is allocated)."""
  d, layers = model_config.d_model, model_config.num_layers
  params = (2 * 65536 * d + model_config.context * d
            + layers * (4 + 2 * model_config.mlp_ratio) * d * d)  # a generous vocabulary
  needed = 4 * params * (4 + 4 * config.num_workers)
  try:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return
  if needed > memory:
    _fail("model.d_model", d, f"a model that fits: model.d_model={d} with model.num_layers="
          f"{layers} and num_workers={config.num_workers} needs about {needed / 2**30:,.0f} "
          f"GiB of float32 copies, and this machine has {memory / 2**30:,.0f} GiB")


# ``fragments.refusal``'s names -> config keys.
_STREAMING_KEYS = {"fragments": "streaming.fragments", "overlap_steps": "streaming.overlap_steps",
                   "fragment_alpha": "streaming.alpha", "reset_optimizer": "inner.reset_optimizer",
                   "quorum": "syncer.quorum", "adaptive_grace": "syncer.adaptive_grace",
                   "grace_window": "syncer.grace_window"}


def _validate_syncer(config: ml_collections.ConfigDict, method: Any) -> None:
  """The syncer keys: a quorum within the workers; grouping only for asynchronous methods."""
  c = config.syncer
  rule = harness.syncer(config)
  refused = (rule.refusal(config.num_workers) if method.synchrony == "async"
             else rule.aggregate_refusal(config.num_workers, method.synchrony))
  if refused:
    name, value, allowed = refused
    _fail(f"syncer.{name}", value, allowed)
  for name, default in (("quorum", 1), ("timeout", None), ("adaptive_grace", 0.0),
                        ("weights", "mean")):
    if c[name] != default and method.synchrony != "async":
      _fail(f"syncer.{name}", c[name], f"{default!r} with method={config.method!r} (the syncer "
            "groups the arrivals of asynchronous methods)")
  if config.outer.merge_order != "merge_then_correct":  # ALGORITHMS.md, "Merge order"
    if config.method != "heloco":
      _fail("outer.merge_order", config.outer.merge_order, "'merge_then_correct' with method="
            f"{config.method!r} (the merge order is HeLoCo's: it corrects arrivals)")
    if not rule.groups:
      _fail("outer.merge_order", config.outer.merge_order, "'merge_then_correct' without "
            "groups of arrivals (syncer.quorum > 1 or a grace window merges them)")
    if rule.aggregate != aggregate_lib.Mean():
      _fail("outer.merge_order", config.outer.merge_order, "'merge_then_correct' with "
            f"syncer.aggregate={config.syncer.aggregate!r} (corrected arrivals merge by the mean)")


def _validate_chaos(config: ml_collections.ConfigDict) -> None:
  """The chaos keys: a schedule that parses and fits the run."""
  key = "chaos.schedule" if config.chaos.schedule else "chaos.rate"
  value = config.chaos[key.split(".")[1]]
  try:
    schedule = harness.membership(config)
  except ValueError as error:
    message = str(error)
    if message.startswith("downtime="):  # the random failures' keys, named as they are
      key, value = "chaos.downtime", config.chaos.downtime
    elif message.startswith("chaos.rate="):
      key, value = "chaos.rate", config.chaos.rate
    _fail(key, value, message.split("; allowed: ", 1)[-1])
  if schedule is None:
    return
  why = schedule.refusal(config.num_workers)
  if why:
    _fail(key, value, f"a schedule this run can take ({why})")


def _validate_faulty(config: ml_collections.ConfigDict, method: Any) -> None:
  """chaos.faulty: workers of this run, some honest, a method that sends pseudo-gradients."""
  if not config.chaos.faulty:
    return
  parsed = faults.Faults.parse(config.chaos.faulty)
  why = parsed.refusal(config.num_workers)
  if why is None and method.synchrony == "step":
    why = "method='ddp' sends gradients every step, not pseudo-gradients"
  if why is None and method.synchrony == "round" and config.streaming.fragments > 1:
    why = "Streaming DiLoCo's workers keep their own θ across rounds"
  if why:
    _fail("chaos.faulty", config.chaos.faulty, f"faulty workers that fit the run ({why})")


# The config keys of PALSGD's inner optimizer: a method takes them or not
# (``_validate_method_keys``).
_PALSGD_INNER_KEYS = ("inner.pseudo_sync_prob", "inner.pseudo_sync_rate")


def _keys_of(method: Any) -> set[str]:
  """The method-specific config keys ``method`` takes."""
  return ({f"outer.{key}" for key in method.outer_keys}
          | {harness.RUN_KEYS[key] for key in method.run_keys}
          | (set(_PALSGD_INNER_KEYS) if method.inner == "palsgd" else set()))


def _validate_method_keys(config: ml_collections.ConfigDict, method: Any) -> None:
  """A key of other methods set away from its default would be ignored: refused, naming the
  methods that take it (``Method.outer_keys``, ``Method.run_keys``, PALSGD's inner keys)."""
  every = set().union(*map(_keys_of, METHODS.values()))
  for key in sorted(every - _keys_of(method)):
    value, default = harness.config_value(config, key), schema.BY_NAME[key].default
    if value != default:
      owners = ", ".join(m.name for m in METHODS.values() if key in _keys_of(m))
      _fail(key, value, f"{'unset' if default is None else repr(default)} with method="
            f"{config.method!r} (a key of {owners})")


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ``ConfigError`` for the first invalid value of ``config``."""
  check_keys(config)
  method = METHODS[config.method]
  try:
    clocks.seconds_per_step(config.speeds, config.num_workers)
  except ValueError as error:
    raise ConfigError(f"config.{error}") from None
  try:
    writers.parse(config.writers)
  except ValueError as error:
    raise ConfigError(f"config.{error}") from None
  validate_distributed(config)
  if method.synchrony not in _runtime_factory(config).synchronies:
    _fail("runtime", config.runtime, f"'simulated' or 'devices' with method={config.method!r}; "
          f"runtime={config.runtime!r} runs the asynchronous methods (async_nesterov, "
          "delayed_nesterov, mla, heloco, cgad). Synchronous methods run across processes with "
          "jax.distributed: runtime='devices' and the distributed.* keys")
  compressing = config.compression.kind != "none" or config.compression.error_feedback
  # the key that asks for compression: kind, or error_feedback on its own
  key, value, off = (("compression.kind", config.compression.kind, "'none'")
                     if config.compression.kind != "none"
                     else ("compression.error_feedback", config.compression.error_feedback,
                           "False"))
  if compressing and method.synchrony == "step":
    _fail(key, value, f"{off} with method='ddp' (it sends gradients every step, not "
          "pseudo-gradients)")
  if config.compression.download:  # ALGORITHMS.md, "Compressed downloads"
    if config.compression.kind == "none":
      _fail("compression.download", True, "False with compression.kind='none' (downloads are "
            "compressed with Δ's kind)")
    if method.synchrony != "async":
      _fail("compression.download", True, f"False with method={config.method!r}; compressed "
            "downloads run the asynchronous methods")
  refused = fragments.refusal(
      method=method, fragments=config.streaming.fragments,
      overlap_steps=config.streaming.overlap_steps, alpha=config.streaming.alpha,
      inner_steps=config.inner_steps,
      reset_optimizer=config.inner.reset_optimizer,
      grace_window=config.syncer.grace_window, dylu=config.dylu, quorum=config.syncer.quorum,
      adaptive_grace=config.syncer.adaptive_grace)
  if refused:
    name, value, allowed = refused
    _fail(_STREAMING_KEYS.get(name, name), value, allowed)
  _validate_syncer(config, method)
  if config.dylu and method.synchrony != "async":
    _fail("dylu", True, f"False with method={config.method!r} (DyLU sets the steps of "
          "asynchronous dispatches)")
  _validate_chaos(config)
  _validate_faulty(config, method)
  _RUNTIME_KEYS[config.runtime](config, method)
  try:
    method.lookahead_dispatch(config.lookahead_dispatch, name="lookahead_dispatch")
    method.resets(config.inner.reset_optimizer, name="inner.reset_optimizer")
  except ValueError as error:
    raise ConfigError(f"config.{error}") from None
  _validate_method_keys(config, method)
  if config.budget.tokens == 0 and config.budget.sim_seconds == 0:
    _fail("budget.tokens", 0, "a token budget > 0, or a budget.sim_seconds > 0 (a run needs "
          "an end)")

  try:
    model_config = model.config_from(config.model)
  except ValueError as error:
    raise ConfigError(f"config.{error}") from None
  _check_fits(config, model_config)

  source = config.data.source
  if config.data.tokenizer != "bytes" and not os.path.exists(str(config.data.tokenizer)):
    _fail("data.tokenizer", config.data.tokenizer, schema.BY_NAME["data.tokenizer"].check.allowed)
  if source in ("text_dir", "jsonl"):
    if not config.data.path or not os.path.isdir(config.data.path):
      _fail("data.path", config.data.path, f"an existing directory for data.source={source!r} "
            "(e.g. the output of `heloco-jax corpus debian_docs`)")
  if source == "tfds" and not config.data.path:
    _fail("data.path", config.data.path, "a tensorflow-datasets name for data.source='tfds'")

  try:
    inner_config = harness.inner_config(config.inner)
    if method.inner == "palsgd":  # only PALSGD pulls toward θ̃
      inner_config.check_pseudo_sync()
  except ValueError as error:
    raise _relabel(error, "inner.") from None

  if method.outer is not None:
    try:
      method.make_outer(config.num_workers, harness.outer_options(config))
    except ValueError as error:
      raise _relabel(error, "outer.", _OUTER_KEYS) from None
