"""The config's one table (``heloco_jax/cli/configs/schema.py``): `--help`, the defaults and the
checks all come from it, and a value its rule refuses fails validation in its words."""

from __future__ import annotations

import pytest

from heloco_jax.cli.configs import default, schema, validation
from heloco_jax.cli.configs import help as config_help
from heloco_jax.training.methods import METHODS

DEFAULT = default.get_config()
KEYS = [key for key, _ in config_help.leaves(DEFAULT)]
TEXT = config_help.describe(DEFAULT)


def _line(key: str) -> str:
  lines = [line for line in TEXT.splitlines() if line.split()[:1] == [key]]
  assert len(lines) == 1, f"{key}: {lines}"
  return lines[0]


def _get(config, key):
  for part in key.split("."):
    config = config[part]
  return config


def _set(config, key, value):
  *path, last = key.split(".")
  for part in path:
    config = config[part]
  config[last] = value


def test_the_default_config_is_the_table_and_has_the_keys_the_contract_names():
  assert KEYS == sorted(key.name for key in schema.KEYS) == sorted(schema.BY_NAME)
  for key in schema.KEYS:
    assert _get(DEFAULT, key.name) == key.default, key.name
  # docs/DESIGN.md, "Command line": keys that must exist.
  for key in ["method", "seed", "num_workers", "inner_steps", "speeds", "data.source",
              "data.partition", "budget.tokens", "budget.sim_seconds",
              "budget.eval_every_tokens", "runtime", "checkpoint.every", "batch_size", "model.d_model", "model.num_layers",
              "model.num_heads", "model.context", "data.path", "data.languages"]:
    assert key in KEYS, key


def test_the_default_config_is_valid():
  validation.validate(default.get_config())


@pytest.mark.parametrize("key", KEYS)
def test_every_key_is_listed_with_its_default_allowed_values_and_meaning(key):
  line = _line(key)
  shown = config_help._show(_get(DEFAULT, key))  # pylint: disable=protected-access
  assert line.split()[1] == shown.split()[0], line
  assert schema.BY_NAME[key].check.allowed in line
  assert schema.BY_NAME[key].meaning in TEXT


def test_defaults_that_defer_to_a_method_or_other_keys_are_placeholders_not_codes():
  deferred = ["lookahead_dispatch", "deterministic", "inner.reset_optimizer",
              "outer.learning_rate", "outer.buffer_size", "palsgd_warmup_steps",
              "rejection_limit", "ray.num_cpus", "ray.cpus_per_worker", "comm.bandwidth"]
  for name in deferred:
    assert _get(DEFAULT, name) is None and schema.BY_NAME[name].type is not None, name
    assert "unset" in _line(name)
  for key in schema.KEYS:
    assert key.default != -1, key.name
    assert "-1:" not in key.meaning and "= the method's default" not in key.meaning


def test_a_placeholder_takes_a_value_of_its_type_on_the_command_line():
  config = default.get_config()
  config.lookahead_dispatch = True
  config.outer.learning_rate = 0.5
  config.method = "mla"
  validation.validate(config)
  with pytest.raises(TypeError):
    config.inner.reset_optimizer = 0  # not a bool: no -1/0/1 codes


def test_allowed_methods_and_presets_are_listed():
  line = _line("method")
  assert "heloco" in line.split()[1]  # the default
  assert "one of: " + ", ".join(METHODS) in line
  assert list(METHODS) == ["ddp", "local_sgd", "diloco", "palsgd", "async_nesterov",
                           "delayed_nesterov", "mla", "heloco", "cgad"]
  for preset in ("homogeneous", "mild", "moderate", "severe", "mixed"):
    assert preset in _line("speeds")
  assert "non_iid, iid, dirichlet" in _line("data.partition")


def test_sections_group_the_keys():
  titles = [line for line in TEXT.splitlines() if line and not line.startswith(" ")]
  assert [t.split(":")[0] for t in titles] == ["run", "budget", "checkpoint", "model", "data", "inner",
                                               "outer", "devices", "distributed",
                                               "ray", "comm", "streaming", "compression",
                                               "syncer", "chaos"]
  assert TEXT.index("\n  outer.keep_threshold ") > TEXT.index("\nouter:")


def test_unknown_keys_are_listed_with_their_type():
  config = default.get_config()
  config.extra_flag = True
  assert "True or False" in config_help.describe(config).split("extra_flag", 1)[1]


# Probes: for each key, a value of its type that its rule refuses must fail validation naming
# the key and saying what the table says.

_CANDIDATES = (-1, -1.5, 2**40, 1.5, "not-a-choice")


def _probe(key: schema.Key):
  for value in _CANDIDATES:
    config = default.get_config()
    try:
      _set(config, key.name, value)
    except (TypeError, ValueError):
      continue  # not of the key's type
    if not key.check(_get(config, key.name)):
      return value
  return None


_PROBED = [key for key in schema.KEYS if _probe(key) is not None]


def test_most_keys_are_probed():
  assert len(_PROBED) >= 50, [key.name for key in _PROBED]


@pytest.mark.parametrize("key", _PROBED, ids=[key.name for key in _PROBED])
def test_validate_refuses_what_the_table_refuses_in_its_words(key):
  config = default.get_config()
  _set(config, key.name, _probe(key))
  with pytest.raises(validation.ConfigError) as error:
    validation.validate(config)
  message = str(error.value)
  assert message.startswith(f"config.{key.name}="), message
  assert f"allowed: {key.check.allowed}" in message, message
