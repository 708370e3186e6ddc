"""`heloco-jax train --help`: every config key with its default and allowed values.

``heloco_jax.configs.help.describe`` lists the keys; the allowed values come
from ``heloco_jax.configs.validation`` (``CHOICES`` are the tuples its checks
use, ``ALLOWED`` the words), and the probes below check that the words say
what ``validate`` enforces.
"""

from __future__ import annotations

import re

import pytest

from heloco_jax.configs import default, help as config_help, validation
from heloco_jax.methods import METHODS

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


def test_the_default_config_has_the_keys_the_contract_names():
  # docs/DESIGN.md, "Command line": keys that must exist.
  for key in ["method", "seed", "num_workers", "inner_steps", "speeds", "data.source",
              "data.partition", "budget.tokens", "budget.sim_seconds", "eval_every_tokens",
              "runtime", "checkpoint_every", "batch_size", "model.d_model", "model.num_layers",
              "model.num_heads", "model.context", "data.path", "data.languages"]:
    assert key in KEYS, key


@pytest.mark.parametrize("key", KEYS)
def test_every_key_is_listed_with_its_default_allowed_values_and_meaning(key):
  line = _line(key)
  shown = config_help._show(_get(DEFAULT, key))  # pylint: disable=protected-access
  assert line.split()[1] == shown.split()[0], line
  assert key in validation.ALLOWED, f"add config.{key} to validation.ALLOWED"
  assert validation.ALLOWED[key] in line
  assert key in config_help.MEANINGS, f"add config.{key} to help.MEANINGS"
  assert config_help.MEANINGS[key] in TEXT


def test_allowed_methods_and_presets_are_listed():
  line = _line("method")
  assert "heloco" in line.split()[1]  # the default
  assert "one of: " + ", ".join(METHODS) in line
  assert list(METHODS) == ["ddp", "local_sgd", "diloco", "palsgd", "async_nesterov",
                           "delayed_nesterov", "mla", "heloco"]
  for preset in ("homogeneous", "mild", "moderate", "severe", "mixed"):
    assert preset in _line("speeds")
  assert "non_iid, iid, dirichlet" in _line("data.partition")


def test_sections_group_the_keys():
  titles = [line for line in TEXT.splitlines() if line and not line.startswith(" ")]
  assert [t.split(":")[0] for t in titles] == ["run", "budget", "model", "data", "inner",
                                               "outer", "fault", "devices", "distributed",
                                               "ray", "comm"]
  assert TEXT.index("\n  outer.keep_threshold ") > TEXT.index("\nouter:")


def test_unknown_keys_are_listed_with_their_type():
  config = default.get_config()
  config.extra_flag = True
  assert "True or False" in config_help.describe(config).split("extra_flag", 1)[1]


# Probes: a value that breaks the stated rule must fail validation naming the key
# and saying the same thing.

_CONTEXT = {  # keys that are only checked in some settings
    "distributed.num_processes": {"method": "diloco", "runtime": "devices",
                                  "checkpoint_every": 0,
                                  "distributed.coordinator": "127.0.0.1:12355"},
}


def _probe(key: str):
  """A value violating ``ALLOWED[key]``, and the words the error must contain."""
  words = re.split(r" \(|; ", validation.ALLOWED[key])[0]
  if key in validation.CHOICES:
    return ("not-a-choice" if isinstance(validation.CHOICES[key][0], str) else 7), None
  match = (re.fullmatch(r"an integer >= (-?\d+)", words)
           or re.fullmatch(r"a number >=? (-?[\d.]+)", words)
           or re.fullmatch(r"a number in [\[(](-?[\d.]+), .*[\])]", words))
  if not match:
    return None, None
  below = float(match.group(1)) - 1  # just outside the lower bound
  return (int(below) if isinstance(_get(DEFAULT, key), int) else below), words


_PROBED = [key for key in KEYS if _probe(key)[0] is not None]


def test_most_keys_are_probed():
  assert len(_PROBED) >= 50, _PROBED


@pytest.mark.parametrize("key", _PROBED)
def test_allowed_text_matches_validate(key):
  value, words = _probe(key)
  config = default.get_config()
  for context_key, context_value in _CONTEXT.get(key, {}).items():
    _set(config, context_key, context_value)
  if key.startswith("ray."):
    config.runtime = "ray"
  _set(config, key, value)
  with pytest.raises(validation.ConfigError) as error:
    validation.validate(config)
  message = str(error.value)
  assert message.startswith(f"config.{key}="), message
  if words:
    assert f"allowed: {words}" in message, message
  else:  # a choice: every allowed value is named
    for choice in validation.CHOICES[key]:
      assert str(choice) in message, message
