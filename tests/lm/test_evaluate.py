"""Validation loss per language and overall, against a direct computation."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from heloco_jax.lm import evaluate, model

CONFIG = model.ModelConfig(d_model=16, num_layers=1, num_heads=2, context=8)


def test_per_language_and_overall_losses_match_direct_computation():
  graphdef, params = model.init(CONFIG, seed=0)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, (10, 9)).astype(np.int32)
  language_ids = np.array([0, 1, 2, 0, 1, 2, 0, 1, 2, 0], np.int32)
  evaluator = evaluate.Evaluator(functools.partial(model.token_losses, graphdef), tokens, language_ids, ["a", "b", "c"], chunk_size=4)
  per_sequence = np.asarray(jnp.mean(model.token_losses(graphdef, params, jnp.asarray(tokens)),
                                     axis=-1))
  want = [per_sequence[language_ids == i].mean() for i in range(3)]
  overall, per_language = evaluator(params)
  np.testing.assert_allclose(per_language, want, rtol=1e-5)  # padding (10 → 12) ignored
  np.testing.assert_allclose(float(overall), np.mean(want), rtol=1e-5)
  metrics = evaluator.as_metrics(params)
  assert set(metrics) == {"val_loss", "val_loss/a", "val_loss/b", "val_loss/c"}
  assert metrics["val_loss/b"] == pytest.approx(want[1], rel=1e-5)


def test_bad_shapes_are_rejected():
  graphdef, _ = model.init(CONFIG, seed=0)
  with pytest.raises(ValueError, match="allowed"):
    evaluate.Evaluator(functools.partial(model.token_losses, graphdef), np.zeros((3, 9), np.int32), np.zeros(2, np.int32), ["a"])
