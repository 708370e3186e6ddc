"""Faulty workers (heloco_jax/runtime/faults.py; the CLI's chaos.faulty; ALGORITHMS.md, "Faulty
workers"): each behaviour on Δ, a sign-flipped worker's Δ arriving negated, determinism per
seed, one-line refusals, and a robust hj.aggregate rule surviving a faulty worker at CLI level."""

import asyncio
import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tiny

import heloco_jax as hj
from heloco_jax.cli.configs import validation
from heloco_jax.lm import harness
from heloco_jax.rundir import checkpoint
from heloco_jax.runtime import faults
from heloco_jax.runtime import state as state_lib


def test_the_spec_parses_into_one_behaviour_per_worker():
  parsed = faults.Faults.parse(" 1:sign, 3:scale=10,4:noise=0.1,5:nan, 6:replay=2 ")
  assert parsed.faults == (faults.Fault(1, "sign"), faults.Fault(3, "scale", 10.0),
                           faults.Fault(4, "noise", 0.1), faults.Fault(5, "nan"),
                           faults.Fault(6, "replay", 2.0))
  assert str(parsed) == "1:sign,3:scale=10,4:noise=0.1,5:nan,6:replay=2"
  assert faults.Faults.parse("") == faults.Faults()
  assert parsed.refusal(7) is None and "worker 6 does not exist" in parsed.refusal(6)
  assert "at least one must be honest" in faults.Faults.parse("0:sign,1:nan").refusal(2)


@pytest.mark.parametrize("spec, message", [
    ("1:flip", "('1:flip')"), ("1", "('1')"), ("1:scale", "scale takes a value"),
    ("1:sign=2", "sign takes no value"), ("1:scale=1", "S finite and not 1"),
    ("1:scale=inf", "S finite and not 1"), ("1:noise=0", "SIGMA finite and > 0"),
    ("1:noise=x", "SIGMA finite and > 0"), ("1:sign,1:nan", "worker 1 named twice"),
    ("1:replay", "replay takes a value"), ("1:replay=0", "N a whole number >= 1"),
    ("1:replay=1.5", "N a whole number >= 1"),
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


def test_a_replaying_worker_sends_its_own_delta_of_n_dispatches_earlier():
  """ReplayState.send: the k-th honest Δ is replaced by the (k − n)-th, the first until there
  are n; other workers' queues are their own."""
  state = state_lib.ReplayState()
  sent = [int(state.send(1, 2, k)) for k in range(6)]
  assert sent == [0, 0, 0, 1, 2, 3]
  assert [int(state.send(3, 1, 10 + k)) for k in range(3)] == [10, 10, 11]
  assert state.queued == [[1, 2], [3, 1]] and state.held == [4, 5, 12]  # n per worker at most


class _Ends(NamedTuple):
  params: Any


class _RoundStub:
  """A round executor whose round r ends at θ − (r + 1)·(worker + 1)."""

  def __init__(self):
    self.round = 0

  def run_round(self, states, batches, keys, anchor):
    self.round += 1
    scale = self.round * (np.arange(K, dtype=np.float32) + 1.0)
    return _Ends(states.params - jnp.asarray(scale)[:, None]), {}


def test_a_replaying_worker_in_rounds_ends_at_theta_minus_its_old_delta():
  executor = faults.FaultyExecutor(_RoundStub(), faults.Faults.parse("1:replay=1"))
  theta = jnp.ones((K, 2))
  for r in range(4):
    ends, _ = executor.run_round(_Ends(theta), None, jax.random.split(jax.random.key(0), K),
                                 None)
    deltas = np.asarray(theta - ends.params)[:, 0]
    honest = (r + 1) * (np.arange(K) + 1.0)
    assert deltas[0] == honest[0] and deltas[2] == honest[2]
    assert deltas[1] == 2.0 * max(r, 1)  # its Δ of one round earlier (the first: its own)


class _Recording:
  """The wrapped executor's honest Δ per worker, in dispatch order."""

  def __init__(self, executor, honest):
    self._executor, self.honest = executor, honest

  def __getattr__(self, name):
    return getattr(self._executor, name)

  def run_worker(self, worker, *args):
    state, delta, loss = self._executor.run_worker(worker, *args)
    self.honest.setdefault(worker, []).append(
        jax.tree.map(np.asarray, self._executor.fetch(delta, "delta")))
    return state, delta, loss


def test_a_replaying_worker_arrives_with_its_previous_delta():
  """MLA with η = 1, μ = 0 (θ ← θ − Δ): each arrival moves θ by what was sent; worker 1
  (replay=1) sends its honest Δ of the dispatch before, the others their own."""
  honest, moves = {}, []
  runtime = faults.faulty(None, faults.Faults.parse("1:replay=1"))
  build = runtime.build

  def recording_build(inner, spec):
    built = build(inner, spec)
    built.executor._executor = _Recording(built.executor._executor, honest)
    return built
  engine = hj.make_engine(
      tiny.regression_loss, tiny.regression_params(),
      [tiny.regression_stream(i) for i in range(K)], method="mla", budget=hj.Budget(steps=40),
      inner_steps=4, speeds=[2.0, 1.0, 2.0], inner_tx=optax.sgd(0.05), metrics_fetch_every=1,
      runtime=dataclasses.replace(runtime, build=recording_build),
      method_options={"learning_rate": 1.0, "momentum": 0.0, "weighting": "none"})
  before = [jax.tree.map(np.asarray, engine.params)]

  def look(row):
    if row.get("event") == "arrival":
      after = jax.tree.map(np.asarray, engine.params)
      moves.append((row["worker"], jax.tree.map(np.subtract, before[0], after)))
      before[0] = after
  asyncio.run(engine.run(on_row=look))
  engine.close()
  arrived = {w: [m for v, m in moves if v == w] for w in range(K)}
  assert len(arrived[1]) >= 4
  for worker, sent in arrived.items():
    for k, move in enumerate(sent):
      expected = honest[worker][max(0, k - 1) if worker == 1 else k]
      for a, b in zip(jax.tree.leaves(move), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  assert not np.allclose(honest[1][1]["w"], honest[1][2]["w"])  # the replay is not the same Δ


class _Stream:
  """``tiny.regression_stream(worker)``, re-iterable (a resumed run reads it anew)."""

  def __init__(self, worker):
    self.worker = worker

  def __iter__(self):
    return tiny.regression_stream(self.worker)


def test_a_run_with_a_replaying_worker_resumes_bit_for_bit(tmp_path):
  def engine():
    return hj.make_engine(
        tiny.regression_loss, tiny.regression_params(), [_Stream(i) for i in range(K)],
        method="heloco",
        budget=hj.Budget(steps=48), inner_steps=4, speeds=[2.0, 1.0, 1.5],
        inner_tx=optax.sgd(0.05), metrics_fetch_every=1,
        runtime=faults.faulty(None, faults.Faults.parse("1:replay=2")))
  uninterrupted = engine()
  asyncio.run(uninterrupted.run())
  uninterrupted.close()
  first, saved = engine(), checkpoint.Checkpointer(str(tmp_path / "checkpoints"))

  def stop_at_the_fifth_arrival(row):
    if row.get("event") == "arrival" and row["outer_updates"] == 5:
      first.request_stop()
  with pytest.raises(hj.Stopped):
    asyncio.run(first.run(on_row=stop_at_the_fifth_arrival))
  arrays, meta = first.snapshot()
  assert meta["replay"]["queued"] == [[1, 2]] and len(arrays["replayed"]) == 2
  saved.save(5, arrays, meta)
  first.close()
  resumed = engine()
  _, arrays, meta = saved.restore(resumed.template)
  resumed.restore(arrays, meta)
  asyncio.run(resumed.run())
  resumed.close()
  assert resumed.version == uninterrupted.version > 5
  for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(uninterrupted.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_replay_is_refused_with_fragments():
  with pytest.raises(ValueError) as error:
    hj.simulate(tiny.regression_loss, tiny.regression_params(),
                [tiny.regression_stream(i) for i in range(K)], method="heloco",
                budget=hj.Budget(steps=8), inner_steps=2,
                streaming=hj.Streaming(fragments=2),
                runtime=faults.faulty(None, faults.Faults.parse("1:replay=1")))
  assert "chaos.faulty='1:replay=1' is not allowed" in str(error.value)
  assert "fragments send one fragment's" in str(error.value) and "\n" not in str(error.value)
