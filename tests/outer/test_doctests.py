"""The ``Examples:`` sections of the public outer rules run as doctests.

Every public rule (``hj.heloco``, ``hj.mla``, ``hj.async_nesterov``,
``hj.delayed_nesterov``) and helper (``hj.heloco_correct``, ``hj.lookahead_params``,
``hj.outer_momentum``, ``hj.arrival_weight``, ``hj.scale_by_arrival_weight``)
shows a short example that checks a value; the API reference (mkdocs) renders
the same text, so what users read is what runs here.
"""

from __future__ import annotations

import doctest
import importlib

import pytest

import heloco_jax as hj

MODULES = [
    "heloco_jax.outer.heloco",
    "heloco_jax.outer.mla",
    "heloco_jax.outer.nesterov",
    "heloco_jax.outer.delayed_nesterov",
    "heloco_jax.outer.cgad",
    "heloco_jax.outer.correction",
    "heloco_jax.outer.lookahead",
    "heloco_jax.outer.weighting",
    "heloco_jax.comm.compress",
    "heloco_jax.comm.fragments",
]

# The public functions that must carry a runnable example.
DOCUMENTED = [
    hj.heloco, hj.mla, hj.async_nesterov, hj.delayed_nesterov, hj.heloco_correct,
    hj.lookahead_params, hj.outer_momentum, hj.arrival_weight, hj.scale_by_arrival_weight,
    hj.cgad, hj.scale_by_age_gate,
]


@pytest.mark.parametrize("name", MODULES)
def test_module_examples_pass(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                           verbose=False)
  assert result.attempted > 0, f"{name} has no doctest examples"
  assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


@pytest.mark.parametrize("function", DOCUMENTED, ids=[f.__name__ for f in DOCUMENTED])
def test_public_rule_has_an_examples_section(function):
  doc = function.__doc__ or ""
  assert "\n  Examples:\n" in doc and ">>> " in doc, f"{function.__name__} has no Examples:"
  assert function.__module__ in MODULES
