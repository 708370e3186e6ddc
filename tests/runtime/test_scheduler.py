"""The simulated engine: exact schedules, sync rounds, identities, budgets, determinism.

Runs go through the engine the CLI builds (``harness.engine_of_config``, ``tiny.simulate``).
"""


import asyncio
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import tiny

from heloco_jax.lm import harness
from heloco_jax.runtime import simulated
from heloco_jax.training import server

_dataset, _config = tiny.dataset, tiny.config


def _run(config, partition="non_iid"):
  return tiny.simulate(config, _dataset(config.num_workers, partition))


def test_hand_built_three_worker_schedule():
  """t = [1, 2, 3] s/step, H = 2: workers take 2, 4 and 6 s per dispatch.

  Worked by hand (ties at equal times go to the lower worker index):
    t=2 w0 (dispatched v0, now v0: τ 0) → v1;  w0 again at 2 → done at 4
    t=4 w0 (v1, τ 0) → v2;  t=4 w1 (v0, τ 2) → v3;  w0 → 6, w1 → 8
    t=6 w0 (v2, τ 1) → v4;  t=6 w2 (v0, τ 4) → v5;  w0 → 8, w2 → 12
    t=8 w0 (v4, τ 1) → v6;  t=8 w1 (v3, τ 3) → v7
  The sim-seconds budget of 9 stops before t = 10 and discards what is in flight.
  """
  summary, rows = _run(_config(speeds=[1.0, 2.0, 3.0], **{"budget.sim_seconds": 9.0}))
  arrivals = [(r["sim_time"], r["worker"], r["staleness"], r["outer_updates"])
              for r in rows if r["event"] == "arrival"]
  assert arrivals == [(2.0, 0, 0, 1), (4.0, 0, 0, 2), (4.0, 1, 2, 3), (6.0, 0, 1, 4),
                      (6.0, 2, 4, 5), (8.0, 0, 1, 6), (8.0, 1, 3, 7)]
  assert summary["outer_updates"] == 7 and summary["sim_time"] == 8.0
  assert summary["tokens"] == 7 * 2 * 4 * 16  # 7 applied dispatches of H·batch·context
  assert summary["mean_staleness"] == pytest.approx(11 / 7)


def test_communication_delays_async_arrivals():
  latency = 0.25  # bandwidth free: each way costs the latency only
  _, rows = _run(_config(speeds=[1.0, 2.0, 3.0], **{"budget.sim_seconds": 5.0,
                                                    "comm.latency": latency}))
  times = [r["sim_time"] for r in rows if r["event"] == "arrival"]
  # w0: 0.25 + 2 + 0.25 = 2.5; w1: 0.25 + 4 + 0.25 = 4.5; w0 again from 2.5: 5.0; w2: 6.5.
  assert times == [2.5, 4.5, 5.0]


def test_sync_round_lasts_as_long_as_the_slowest_worker_plus_allreduce():
  config = _config("diloco", speeds=[1.0, 2.0, 3.0], **{"comm.latency": 0.5,
                                                          "comm.bandwidth": 1e6})
  config.budget.tokens = 3 * (3 * 2 * 4 * 16)  # three rounds
  summary, _ = _run(config)
  num_bytes = sum(x.nbytes for x in jax.tree.leaves(harness.default_problem(
      config, _dataset(3)).params))
  allreduce = 0.5 + 2 * 2 / 3 * num_bytes / 1e6
  assert summary["outer_updates"] == 3
  assert summary["sim_time"] == pytest.approx(3 * (2 * 3.0 + allreduce))


def test_local_sgd_equals_diloco_with_unit_rate_and_no_momentum():
  budget = {"budget.tokens": 4 * 3 * 2 * 4 * 16}
  local, _ = _run(_config("local_sgd", **budget))
  diloco, _ = _run(_config("diloco", **budget, **{"outer.learning_rate": 1.0,
                                                  "outer.momentum": 0.0}))
  assert local["outer_updates"] == diloco["outer_updates"] == 4
  assert local["final_val_loss"] == diloco["final_val_loss"]


def test_palsgd_with_p_zero_equals_diloco():
  common = {"budget.tokens": 4 * 3 * 2 * 4 * 16, "inner.reset_optimizer": False}
  palsgd, _ = _run(_config("palsgd", palsgd_warmup_steps=0, **common,
                           **{"inner.pseudo_sync_prob": 0.0}))
  diloco, _ = _run(_config("diloco", **common))
  assert palsgd["outer_updates"] == diloco["outer_updates"] == 4
  assert palsgd["final_val_loss"] == pytest.approx(diloco["final_val_loss"], rel=1e-5)


def test_palsgd_pseudo_sync_steps_read_no_tokens():
  summary, _ = _run(_config("palsgd", palsgd_warmup_steps=0, inner_steps=8,
                            speeds="homogeneous",
                            **{"budget.sim_seconds": 25.0, "inner.pseudo_sync_prob": 0.5}))
  full_rounds_tokens = summary["outer_updates"] * 3 * 8 * 4 * 16
  assert summary["outer_updates"] >= 1 and 0 < summary["tokens"] < full_rounds_tokens


@pytest.mark.parametrize("coins", ["shared", "independent"])
def test_palsgd_coins_shared_means_every_worker_pseudo_syncs_on_the_same_steps(
    coins, monkeypatch):
  patterns = []
  run_round = simulated.LocalExecutor.run_round

  def recording(self, *args):
    states, metrics = run_round(self, *args)
    patterns.append(np.asarray(metrics.pseudo_sync))  # (K, H)
    return states, metrics
  monkeypatch.setattr(simulated.LocalExecutor, "run_round", recording)
  summary, _ = _run(_config("palsgd", palsgd_warmup_steps=0, inner_steps=8,
                            speeds="homogeneous", **{"budget.sim_seconds": 40.0,
                                                     "inner.pseudo_sync_prob": 0.4,
                                                     "inner.palsgd_coins": coins}))
  coins_drawn = np.stack(patterns)  # (rounds, K, H)
  assert summary["outer_updates"] >= 2 and 0 < coins_drawn.mean() < 1
  same = (coins_drawn == coins_drawn[:, :1]).all()
  assert same if coins == "shared" else not same
  if coins == "shared":  # equal real steps: no worker waits for another in a round
    real = (~coins_drawn).sum(axis=2)
    assert (real == real[:, :1]).all()


def test_token_budget_stops_before_the_arrival_that_would_pass_it():
  per_dispatch = 2 * 4 * 16
  summary, rows = _run(_config(**{"budget.tokens": 5 * per_dispatch + per_dispatch // 2}))
  assert summary["tokens"] == 5 * per_dispatch and summary["outer_updates"] == 5
  assert sum(r["event"] == "arrival" for r in rows) == 5


def test_ddp_budget_counts_every_workers_tokens():
  summary, _ = _run(_config("ddp", speeds=[1.0, 15.0, 3.0], **{"budget.tokens": 7 * 3 * 4 * 16}))
  assert summary["outer_updates"] == 7 and summary["tokens"] == 7 * 3 * 4 * 16
  assert summary["sim_time"] == pytest.approx(7 * 15.0)  # every step waits for the slowest


@pytest.mark.parametrize("overlap,step_seconds", [(0.0, 15.0 + 9.0), (0.5, 15.0 + 1.5)])
def test_ddp_steps_hide_the_overlapped_part_of_the_allreduce(overlap, step_seconds):
  config = _config("ddp", speeds=[1.0, 15.0, 3.0], **{"budget.tokens": 4 * 3 * 4 * 16,
                                                      "comm.latency": 9.0,
                                                      "comm.ddp_overlap": overlap})
  summary, _ = _run(config)
  assert summary["sim_time"] == pytest.approx(4 * step_seconds)


def test_dylu_gives_slow_workers_fewer_steps():
  summary, rows = _run(_config(speeds=[1.0, 4.0, 4.0], inner_steps=8, dylu=True,
                               **{"budget.sim_seconds": 8.0}))
  first = {r["worker"]: r["sim_time"] for r in reversed(rows) if r["event"] == "arrival"}
  assert first == {0: 8.0, 1: 8.0, 2: 8.0}  # H_i = 8, 2, 2 steps: all done at t = 8


def test_grace_window_combines_arrivals_into_one_update():
  summary, rows = _run(_config(speeds=[1.0, 1.0, 1.0],
                               **{"syncer.grace_window": 0.5, "budget.sim_seconds": 2.0}))
  assert sum(r["event"] == "arrival" for r in rows) == 3
  assert summary["outer_updates"] == 1


def test_same_config_and_seed_give_identical_numbers():
  config = _config("heloco", speeds="mixed", num_workers=5, jitter=0.2,
                   **{"budget.tokens": 20 * 2 * 4 * 16})
  first, first_rows = _run(config)
  second, second_rows = _run(config)
  keys = ["tokens", "sim_time", "outer_updates", "initial_val_loss", "final_val_loss",
          "mean_staleness", "num_params"]
  assert [first[k] for k in keys] == [second[k] for k in keys]
  assert first_rows == second_rows


def test_rows_fetched_in_batches_equal_rows_fetched_one_by_one():
  config = _config("heloco", speeds="mixed", num_workers=4, **{"budget.tokens": 9 * 2 * 4 * 16})
  config.metrics_fetch_every = 4
  handed_on = []
  summary, batched = tiny.simulate(config, _dataset(4), on_row=handed_on.append)
  config.metrics_fetch_every = 1
  _, one_by_one = _run(config)
  assert summary["outer_updates"] == 9 and batched == one_by_one == handed_on
  arrival = [r for r in batched if r["event"] == "arrival"][-1]
  assert all(type(v) in (int, float, str, type(None)) for v in arrival.values())


def test_work_in_flight_is_computed_lazily_with_the_same_numbers(monkeypatch):
  """In-flight work runs when its arrival comes up: the discarded tail never runs,
  and the rows equal those of a run that computes every dispatch at once."""
  config = _config("heloco", speeds="severe", num_workers=8, jitter=0.2,
                   **{"budget.tokens": 6 * 2 * 4 * 16})
  runs = []
  real_run_worker = simulated.LocalExecutor.run_worker

  def counting_run_worker(self, *args, **kwargs):
    runs.append(args[0])
    return real_run_worker(self, *args, **kwargs)
  monkeypatch.setattr(simulated.LocalExecutor, "run_worker", counting_run_worker)
  summary, lazy_rows = _run(config)
  arrivals = sum(r["event"] == "arrival" for r in lazy_rows)
  assert arrivals == 6 and summary["outer_updates"] == 6
  # 8 dispatched at t = 0, 6 re-dispatched: only the 6 that arrive run, not the 7th,
  # which the budget discards (the next arrival runs ahead only within the budget).
  assert len(runs) == arrivals < 8 + arrivals

  # Eager: snapshot() at every row computes all work in flight, as computing at
  # dispatch does.
  runs.clear()
  engine, _ = harness.engine_of_config(config, _dataset(config.num_workers))
  def force(row):
    if engine.state.workers is not None:
      engine.snapshot()
  asyncio.run(engine.run(force))
  assert len(runs) == 8 + arrivals
  assert engine.rows == lazy_rows


TWO_DEVICES = """
import os, sys, json
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count={n}"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, {tests!r})
import asyncio, jax, numpy as np, tiny
from heloco_jax.lm import harness
config = tiny.config("heloco", 3, jitter=0.2, **{{"budget.tokens": 3000, "budget.eval_every_tokens": 1000}})
engine, _ = harness.engine_of_config(config, tiny.dataset(3))
asyncio.run(engine.run())
where = sorted({{d.id for w in engine.state.workers for x in jax.tree.leaves(w)
                 for d in x.devices()}})
print(json.dumps({{"rows": engine.rows, "where": where,
                  "concurrency": engine.runtime.executor.concurrency,
                  "params": [np.asarray(x).tolist() for x in jax.tree.leaves(engine.params)]}}))
"""


@pytest.mark.slow  # 50–120 s: the default suite stays under 15 minutes
def test_workers_on_two_host_devices_give_the_numbers_of_one():
  """In-flight workers spread over 2 host devices (run concurrently) change nothing."""
  runs = []
  for n in (1, 2):
    out = subprocess.run([sys.executable, "-c", TWO_DEVICES.format(
        n=n, tests=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))], capture_output=True, text=True,
        timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
  one, two = runs
  assert (one["concurrency"], two["concurrency"]) == (1, 2)
  assert one["where"] == [0] and two["where"] == [0, 1]  # worker i on device i % 2
  assert two["rows"] == one["rows"] and two["params"] == one["params"]


@pytest.mark.parametrize("method", ["ddp", "local_sgd", "diloco", "async_nesterov",
                                    "delayed_nesterov", "mla", "heloco", "palsgd"])
def test_every_method_learns_on_a_tiny_run(method):
  config = _config(method, num_workers=3, speeds="homogeneous", inner_steps=4,
                   **{"data.partition": "iid", "budget.tokens": 3 * 12 * 4 * 4 * 16})
  summary, rows = _run(config, partition="iid")
  assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.5, summary
  assert np.isfinite(summary["final_val_loss"])
  assert rows[0]["event"] == "eval" and rows[-1]["event"] == "eval"


def test_alignment_is_the_mean_over_leaves_of_the_cosine_with_the_momentum():
  rng = np.random.default_rng(0)
  delta = {"a": rng.normal(size=(3, 4)), "b": rng.normal(size=5), "c": np.zeros(2)}
  momentum = {"a": rng.normal(size=(3, 4)), "b": -delta["b"] * 2.0, "c": rng.normal(size=2)}
  cos_a = np.dot(delta["a"].ravel(), momentum["a"].ravel()) / (
      np.linalg.norm(delta["a"]) * np.linalg.norm(momentum["a"]))
  expected = (cos_a - 1.0 + 0.0) / 3  # b is exactly opposed; c has Δ = 0
  got = server.alignment(jax.tree.map(np.float32, delta), jax.tree.map(np.float32, momentum))
  assert float(got) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("method", ["async_nesterov", "delayed_nesterov", "mla", "heloco"])
def test_every_async_arrival_row_carries_its_alignment(method):
  _, rows = _run(_config(method, speeds=[1.0, 1.5, 2.0], **{"budget.sim_seconds": 12.0}))
  cosines = [r["cosine_mean"] for r in rows if r["event"] == "arrival"]
  assert len(cosines) >= 8
  assert cosines[0] == 0.0  # the first arrival meets m = 0
  assert all(-1.0 <= c <= 1.0 for c in cosines) and any(abs(c) > 0.01 for c in cosines[1:])
