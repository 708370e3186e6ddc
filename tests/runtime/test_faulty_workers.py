"""Faulty workers (heloco_jax/runtime/faults.py; the CLI's chaos.faulty; ALGORITHMS.md, "Faulty
workers"): each behaviour on Δ, a sign-flipped worker's Δ arriving negated, determinism per
seed, one-line refusals, and a robust hj.aggregate rule surviving a faulty worker at CLI level."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tiny

import heloco_jax as hj
from heloco_jax.cli.configs import validation
from heloco_jax.lm import harness
from heloco_jax.runtime import faults


def test_the_spec_parses_into_one_behaviour_per_worker():
  parsed = faults.Faults.parse(" 1:sign, 3:scale=10,4:noise=0.1,5:nan ")
  assert parsed.faults == (faults.Fault(1, "sign"), faults.Fault(3, "scale", 10.0),
                           faults.Fault(4, "noise", 0.1), faults.Fault(5, "nan"))
  assert str(parsed) == "1:sign,3:scale=10,4:noise=0.1,5:nan"
  assert faults.Faults.parse("") == faults.Faults()
  assert parsed.refusal(6) is None and "worker 5 does not exist" in parsed.refusal(5)
  assert "at least one must be honest" in faults.Faults.parse("0:sign,1:nan").refusal(2)


@pytest.mark.parametrize("spec, message", [
    ("1:flip", "('1:flip')"), ("1", "('1')"), ("1:scale", "scale takes a value"),
    ("1:sign=2", "sign takes no value"), ("1:scale=1", "S finite and not 1"),
    ("1:scale=inf", "S finite and not 1"), ("1:noise=0", "SIGMA finite and > 0"),
    ("1:noise=x", "SIGMA finite and > 0"), ("1:sign,1:nan", "worker 1 named twice"),
])
def test_bad_specs_are_refused_in_one_line_naming_the_key(spec, message):
  with pytest.raises(ValueError) as error:
    faults.Faults.parse(spec)
  assert str(error.value).startswith(f"chaos.faulty={spec!r} is not allowed")
  assert message in str(error.value) and "\n" not in str(error.value)


def test_each_behaviour_alters_delta_as_documented():
  delta = {"a": jnp.arange(1.0, 7.0).reshape(2, 3), "b": jnp.asarray([0.5, -2.0], jnp.bfloat16)}
  key = jax.random.key(3)
  sign = faults.alter(faults.Fault(0, "sign"), delta, key)
  assert all(np.array_equal(-np.asarray(x), np.asarray(y))
             for x, y in zip(jax.tree.leaves(delta), jax.tree.leaves(sign)))
  scaled = faults.alter(faults.Fault(0, "scale", -10.0), delta, key)
  assert np.array_equal(np.asarray(scaled["a"]), -10.0 * np.asarray(delta["a"]))
  assert scaled["b"].dtype == jnp.bfloat16
  assert np.isnan(np.asarray(faults.alter(faults.Fault(0, "nan"), delta, key)["a"])).all()
  noisy = faults.alter(faults.Fault(0, "noise", 0.5), delta, key)
  again = faults.alter(faults.Fault(0, "noise", 0.5), delta, key)
  other = faults.alter(faults.Fault(0, "noise", 0.5), delta, jax.random.key(4))
  assert np.array_equal(np.asarray(noisy["a"]), np.asarray(again["a"]))  # per key
  assert not np.array_equal(np.asarray(noisy["a"]), np.asarray(other["a"]))
  spread = np.std(np.asarray(noisy["a"]) - np.asarray(delta["a"]))
  rms = np.sqrt(np.mean(np.square(np.asarray(delta["a"]))))
  assert 0.1 * rms < spread < 1.5 * rms  # σ = 0.5 of the leaf's rms, six draws


K = 3


def _first_arrival(spec, speeds=(2.0, 1.0, 2.0)):
  """θ0 − θ1 after the run's one arrival (worker 1's, the fastest) with θ ← θ − Δ (MLA with
  η = 1, μ = 0, ρ = 1): the Δ the server received."""
  params = tiny.regression_params()
  result = hj.simulate(
      tiny.regression_loss, params, [tiny.regression_stream(i) for i in range(K)],
      method="mla", budget=hj.Budget(steps=4), inner_steps=4, speeds=list(speeds),
      inner_tx=optax.sgd(0.05), runtime=faults.faulty(None, faults.Faults.parse(spec)),
      method_options={"learning_rate": 1.0, "momentum": 0.0, "weighting": "none"})
  assert result.summary["outer_updates"] == 1
  return jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64),
                      params, result.params)


def test_a_sign_flipped_workers_delta_arrives_negated():
  clean, flipped, other = _first_arrival(""), _first_arrival("1:sign"), _first_arrival("0:sign")
  assert np.abs(clean["w"]).max() > 1e-3
  for name in ("w", "v"):
    np.testing.assert_allclose(flipped[name], -clean[name], atol=1e-7)
    assert np.array_equal(other[name], clean[name])  # another worker's fault: not this Δ


def test_a_round_takes_the_faulty_workers_altered_delta():
  """local_sgd: θ1 = mean_i end_i, so θ0 − θ1 = mean_i Δ_i; a sign-flipped worker 1 moves it by
  −2Δ_1/K, and a scaled one by (s − 1)Δ_1/K: from the two, Δ_1 twice, the same."""
  params = tiny.regression_params()
  def run(spec):
    result = hj.simulate(
        tiny.regression_loss, params, [tiny.regression_stream(i) for i in range(K)],
        method="local_sgd", budget=hj.Budget(steps=4 * K), inner_steps=4,
        inner_tx=optax.sgd(0.05), runtime=faults.faulty(None, faults.Faults.parse(spec)))
    return np.asarray(params["v"], np.float64) - np.asarray(result.params["v"], np.float64)
  clean, flipped, scaled = run(""), run("1:sign"), run("1:scale=3")
  from_sign = (clean - flipped) * K / 2
  from_scale = (scaled - clean) * K / 2
  assert np.abs(from_sign).max() > 1e-3
  np.testing.assert_allclose(from_sign, from_scale, atol=1e-6)


def test_nan_is_rejected_and_noise_is_the_same_per_seed():
  result = hj.simulate(
      tiny.regression_loss, tiny.regression_params(),
      [tiny.regression_stream(i) for i in range(K)], method="mla", budget=hj.Budget(steps=24),
      inner_steps=4, speeds=[2.0, 1.0, 2.0], inner_tx=optax.sgd(0.05),
      runtime=faults.faulty(None, faults.Faults.parse("1:nan")))
  rejected = [r for r in result.history if r["event"] == "rejected"]
  applied = [r for r in result.history if r["event"] == "arrival"]
  assert rejected and {(r["worker"], r["reason"]) for r in rejected} == {(1, "nan")}
  assert applied and {r["worker"] for r in applied} == {0, 2}
  noisy, again = _first_arrival("1:noise=0.3"), _first_arrival("1:noise=0.3")
  assert np.array_equal(noisy["w"], again["w"]) and not np.allclose(
      noisy["w"], _first_arrival("")["w"], atol=1e-6)


def test_refusals_where_faults_cannot_apply():
  for method, spec, message in (("ddp", "1:sign", "not pseudo-gradients"),
                                ("mla", "5:sign", "worker 5 does not exist")):
    with pytest.raises(ValueError) as error:
      hj.simulate(tiny.regression_loss, tiny.regression_params(),
                  [tiny.regression_stream(i) for i in range(K)], method=method,
                  budget=hj.Budget(steps=4), inner_steps=2,
                  runtime=faults.faulty(None, faults.Faults.parse(spec)))
    assert f"chaos.faulty='{spec}' is not allowed" in str(error.value) and message in str(
        error.value) and "\n" not in str(error.value)
  for overrides, message in (({"method": "ddp"}, "not pseudo-gradients"),
                             ({"chaos.faulty": "3:sign"}, "worker 3 does not exist"),
                             ({"chaos.faulty": "1:flip"}, "allowed: '' (none)")):
    config = tiny.config(**{"budget.tokens": 1600, "chaos.faulty": "1:sign", **{
        k: v for k, v in overrides.items() if k != "method"}})
    config.method = overrides.get("method", config.method)
    with pytest.raises(Exception) as error:
      validation.validate(config)
    assert "config.chaos.faulty=" in str(error.value) and message in str(error.value)


def test_a_robust_rule_survives_a_faulty_worker_on_the_cli():
  """Four workers of TinyGPT (tests/tiny.py), diloco; worker 0 sends −10·Δ."""
  def loss(faulty, aggregate):
    config = tiny.config("diloco", num_workers=4, **{
        "budget.tokens": 4 * 64 * 40, "chaos.faulty": faulty, "syncer.aggregate": aggregate})
    validation.validate(config)
    summary, _ = tiny.simulate(config)
    return summary["final_val_loss"]
  config = tiny.config("diloco", num_workers=4, **{"chaos.faulty": "0:scale=-10"})
  assert harness.engine_options(config)["runtime"].build.__qualname__ == "faulty.<locals>.build"
  clean, poisoned, guarded = (loss("", "mean"), loss("0:scale=-10", "mean"),
                              loss("0:scale=-10", "median()"))
  assert poisoned >= 1.5 * clean, (clean, poisoned)
  assert guarded <= 1.25 * clean, (clean, guarded)
