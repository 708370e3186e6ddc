"""The syncer policies (heloco_jax/comm/syncer.py; ALGORITHMS.md, "Syncer policies"): quorum,
timeout, grace window (fixed and adaptive), token-weighted merges, and their identities."""

import asyncio
import collections
import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tiny

import heloco_jax as hj
from heloco_jax.cli.configs import validation
from heloco_jax.comm import syncer as syncer_lib
from heloco_jax.runtime import simulated
from heloco_jax.training import server as server_lib


class _Job:
  def __init__(self, finish):
    self.finish = finish


def _groups(rule, finishes):
  """The groups (workers, close time) the simulated queue pops for jobs at ``finishes``."""
  queue = simulated.SimulatedArrivals()
  for worker, at in enumerate(finishes):
    queue.push(worker, _Job(at))
  out = []
  while len(queue):
    now, group, times = asyncio.run(queue.pop(rule))
    assert times == sorted(times) and [finishes[w] for w in group] == times
    out.append((group, now))
  return out


@pytest.mark.parametrize("rule, want", [
    # One update per arrival (the default): simultaneous arrivals stay apart.
    (syncer_lib.GroupRule(), [([0], 1.0), ([1], 2.0), ([2], 2.0), ([3], 7.0), ([4], 20.0)]),
    # A quorum of 2: pairs, each closing at its second arrival; the last alone (none left).
    (syncer_lib.GroupRule(quorum=2), [([0, 1], 2.0), ([2, 3], 7.0), ([4], 20.0)]),
    # ... with a timeout of 3 s: worker 3 (at 7) is past 2 + 3 and waits for the next group,
    # which closes at 7 + 3 = 10 without a second arrival; so does worker 4's, at 20.
    (syncer_lib.GroupRule(quorum=2, timeout=3.0),
     [([0, 1], 2.0), ([2], 5.0), ([3], 10.0), ([4], 20.0)]),
    # A grace window of 1 s after the close: worker 2 (at 2 = 1 + 1) joins worker 0's group.
    (syncer_lib.GroupRule(window=1.0), [([0, 1, 2], 2.0), ([3], 7.0), ([4], 20.0)]),
    # Quorum 2 then 5 s of grace: worker 3 (at 7 = 2 + 5) joins.
    (syncer_lib.GroupRule(quorum=2, window=5.0), [([0, 1, 2, 3], 7.0), ([4], 20.0)]),
])
def test_the_group_rule_on_the_simulated_queue(rule, want):
  assert _groups(rule, [1.0, 2.0, 2.0, 7.0, 20.0]) == want


def test_the_adaptive_window_follows_the_mean_gap():
  gap, last = syncer_lib.update_gap(None, None, [1.0])
  assert (gap, last) == (None, 1.0)  # one arrival: no gap yet
  gap, last = syncer_lib.update_gap(gap, last, [3.0, 4.0])
  assert last == 4.0 and gap == pytest.approx(0.9 * 2.0 + 0.1 * 1.0)
  syncer = hj.Syncer(adaptive_grace=2.0, grace_window=100.0)
  assert syncer.rule(None).window == 0.0 and syncer.rule(gap).window == pytest.approx(2 * gap)
  assert hj.Syncer(grace_window=3.0).rule(gap).window == 3.0


def test_token_weights_are_exactly_one_for_equal_tokens():
  assert hj.Syncer(weights="tokens").merge_weights([640, 640, 640]) == [1.0, 1.0, 1.0]
  assert hj.Syncer(weights="tokens").merge_weights([100, 300]) == [0.5, 1.5]
  assert hj.Syncer().merge_weights([100, 300]) == [1.0, 1.0]


def test_a_group_merges_its_deltas_with_the_weights_against_numpy():
  """ρ(τ_max)·Δ = Σ_j ω_j·ρ(τ_j)·Δ_j / |G| with polynomial ρ, then θ ← θ − Δ_applied."""
  params = {"w": jnp.zeros(3, jnp.float32)}
  tx = optax.chain(hj.scale_by_arrival_weight(4, "polynomial"), optax.sgd(1.0))
  server = server_lib.OuterServer(tx, params)
  rng = np.random.default_rng(0)
  deltas = [{"w": jnp.asarray(rng.standard_normal(3), jnp.float32)} for _ in range(2)]
  server.update([1, 3], *deltas, weights=[0.5, 1.5])
  rho = lambda tau: 0.5 / math.sqrt(1 + tau)
  want = -(0.5 * rho(1) * np.asarray(deltas[0]["w"]) + 1.5 * rho(3) * np.asarray(deltas[1]["w"]))
  np.testing.assert_allclose(np.asarray(server.params["w"]), want / 2, rtol=1e-6)


def _run(method="heloco", keys=None, **options):
  """The tiny run at close paces (1, 1.3, 1.7 s per step: arrivals interleave)."""
  config = tiny.config(method, **{"budget.tokens": 1600, "budget.eval_every_tokens": 800,
                                  "speeds": [1.0, 1.3, 1.7], **(keys or {})})
  return tiny.simulate(config, **options)


@pytest.mark.parametrize("method", [pytest.param("async_nesterov", marks=pytest.mark.slow),
                                    "heloco"])
def test_quorum_one_and_token_weights_are_todays_runs_bit_for_bit(method):
  plain, plain_rows = _run(method)
  for syncer in (hj.Syncer(weights="tokens"), hj.Syncer(quorum=1, timeout=5.0)):
    summary, rows = _run(method, syncer=syncer)
    assert rows == plain_rows
    assert summary["final_val_loss"] == plain["final_val_loss"]


def test_grace_window_is_the_syncers_grace_window():
  summary, rows = _run(keys={"syncer.grace_window": 1.0})  # the CLI's key
  again, rows_again = _run(syncer=hj.Syncer(grace_window=1.0))
  assert rows == rows_again and summary["final_val_loss"] == again["final_val_loss"]
  per_update = collections.Counter(r["outer_updates"] for r in rows if r["event"] == "arrival")
  assert max(per_update.values()) > 1  # the window merged arrivals


def test_a_quorum_merges_that_many_arrivals_and_waits_for_them():
  plain, _ = _run()
  summary, rows = _run(syncer=hj.Syncer(quorum=2))
  arrivals = [r for r in rows if r["event"] == "arrival"]
  per_update = collections.Counter(r["outer_updates"] for r in arrivals)
  assert set(per_update.values()) <= {1, 2} and list(per_update.values()).count(2) >= 2
  assert all(n == 2 for v, n in per_update.items() if v < max(per_update))  # only the last short
  assert summary["outer_updates"] == len(per_update) < len(arrivals)
  assert summary["sim_time"] > plain["sim_time"]  # waiting for the quorum costs time
  again, rows_again = _run(syncer=hj.Syncer(quorum=2))
  assert rows_again == rows  # deterministic


def test_an_adaptive_grace_window_merges_and_replays():
  summary, rows = _run(syncer=hj.Syncer(adaptive_grace=1.0))
  per_update = collections.Counter(r["outer_updates"] for r in rows if r["event"] == "arrival")
  assert max(per_update.values()) > 1
  again, rows_again = _run(syncer=hj.Syncer(adaptive_grace=1.0))
  assert rows_again == rows and summary["final_val_loss"] == again["final_val_loss"]


@pytest.mark.parametrize("options, message", [
    (dict(syncer=hj.Syncer(quorum=4)), "syncer.quorum=4 is not allowed; allowed: an integer "
                                       "in [1, 3]"),
    (dict(syncer=hj.Syncer(grace_window=-1.0)), "syncer.grace_window=-1.0 is not allowed"),
    (dict(syncer=hj.Syncer(weights="max")), "syncer.weights='max' is not allowed"),
    (dict(syncer=hj.Syncer(quorum=2, timeout=0.0)), "syncer.timeout=0.0 is not allowed"),
    (dict(syncer="q2"), "syncer='q2' is not allowed; allowed: None or hj.Syncer"),
    (dict(method="diloco", syncer=hj.Syncer(quorum=2)), "is not allowed with method='diloco'"),
])
def test_syncers_a_run_cannot_take_are_refused_in_one_line(options, message):
  method = options.pop("method", "heloco")
  with pytest.raises(ValueError) as error:
    hj.make_engine(lambda p, b: jnp.sum(p["w"] ** 2), {"w": jnp.ones(2)},
                   [[{"x": np.zeros(1)}]] * 3, method=method, budget=hj.Budget(steps=40),
                   **options)
  assert message in str(error.value) and "\n" not in str(error.value)


def test_a_grace_window_has_one_place_the_syncer():
  """No shorthand beside ``syncer`` that could contradict it: make_engine takes no
  ``grace_window``."""
  with pytest.raises(TypeError, match=r"grace_window=, which was renamed: use "
                     r"syncer=hj\.Syncer\(grace_window=\.\.\.\)"):
    hj.make_engine(lambda p, b: jnp.sum(p["w"] ** 2), {"w": jnp.ones(2)},  # type: ignore
                   [[{"x": np.zeros(1)}]] * 3, syncer=hj.Syncer(quorum=2),
                   budget=hj.Budget(steps=40), grace_window=1.0)


@pytest.mark.parametrize("key, value, message", [
    ("syncer.quorum", 6, "config.syncer.quorum=6 is not allowed; allowed: an integer in [1, 5]"),
    ("syncer.weights", "max", "config.syncer.weights='max' is not allowed"),
])
def test_bad_syncer_config_keys_fail_in_one_line(key, value, message):
  config = tiny.config("heloco", num_workers=5, **{"budget.tokens": 1600, key: value})
  with pytest.raises(Exception) as error:
    validation.validate(config)
  assert message in str(error.value)


def test_the_syncer_is_part_of_a_workdirs_settings(tmp_path):
  """A resume with another syncer is a different run (config.json differs)."""
  engine = hj.make_engine(lambda p, b: jnp.sum(p["w"] ** 2), {"w": jnp.ones(2)},
                          [[{"x": np.zeros(1)}] * 100] * 3, syncer=hj.Syncer(quorum=2),
                          budget=hj.Budget(steps=40),  # a quorum's 2 dispatches
                          workdir=str(tmp_path))
  engine.close()
  text = (tmp_path / "config.json").read_text()
  assert '"quorum": 2' in text and '"timeout": null' in text

