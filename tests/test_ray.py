"""runtime=ray (heloco_jax/runtime/ray.py): a local Ray cluster of 2 CPUs, from the CLI."""

import collections
import json

import numpy as np
import pytest

import tiny
from heloco_jax import train
from heloco_jax.configs import validation

TINY = ["--config.model.d_model=32", "--config.model.num_layers=1", "--config.model.context=16",
        "--config.batch_size=4", "--config.inner_steps=2",
        "--config.data.max_bytes_per_language=40000", "--config.data.val_sequences_per_language=8"]


def _rows(workdir):
  with open(workdir / "metrics.jsonl") as f:
    return [json.loads(line) for line in f]


def test_heloco_on_ray_learns_and_a_killed_worker_actor_neither_stops_nor_corrupts_it(tmp_path):
  budget = 12_000
  code = train.main([f"--workdir={tmp_path}", "--config.runtime=ray", "--config.ray.num_cpus=2",
                     "--config.num_workers=3", f"--config.budget.tokens={budget}",
                     "--config.eval_every_tokens=4000", "--config.checkpoint_every=20",
                     # worker 1's actor is killed at its 3rd arrival
                     "--config.fault.kill_worker=1", "--config.fault.arrival=3", *TINY])
  assert code == 0
  summary = json.loads((tmp_path / "summary.json").read_text())
  rows = _rows(tmp_path)
  arrivals = [r for r in rows if r["event"] == "arrival"]
  counts = collections.Counter(r["worker"] for r in arrivals)

  # It learns, on the real clock, up to the token budget (the last arrival would pass it).
  step_tokens = 2 * 4 * 16
  assert budget - 3 * step_tokens < summary["tokens"] <= budget
  assert summary["final_val_loss"] < summary["initial_val_loss"] - 2.0
  assert np.isfinite(summary["final_val_loss"])

  # The death is counted once; worker 1's work moved to a live actor and kept arriving.
  redispatched = [r for r in rows if r["event"] == "redispatched"]
  assert len(redispatched) == 1
  assert redispatched[0]["worker"] == 1 and redispatched[0]["lost_actor"] == 1
  assert redispatched[0]["actor"] in (0, 2)
  after = rows.index(redispatched[0])
  assert any(r["event"] == "arrival" and r["worker"] == 1 for r in rows[after:])
  assert set(counts) == {0, 1, 2} and counts[1] > 3

  # The arrival log is consistent: one outer update per arrival, in order, with
  # staleness below the update count and real time never going back.
  assert [r["outer_updates"] for r in arrivals] == list(range(1, len(arrivals) + 1))
  assert summary["outer_updates"] == len(arrivals)
  assert all(0 <= r["staleness"] < r["outer_updates"] for r in arrivals)
  times = [r["sim_time"] for r in rows if "sim_time" in r]
  assert times == sorted(times)
  assert summary["mean_staleness"] == pytest.approx(np.mean([r["staleness"] for r in arrivals]))
  assert all(np.isfinite(r["cosine_mean"]) for r in arrivals)
  assert (tmp_path / "checkpoints").is_dir()


@pytest.mark.parametrize("overrides, message", [
    (dict(runtime="ray", method="diloco"),
     "runtime='ray' runs the asynchronous methods (async_nesterov, delayed_nesterov, mla, "
     "heloco). Synchronous methods run across processes with jax.distributed"),
    ({"runtime": "ray", "devices.slowdown": "1,2"}, "config.devices.slowdown='1,2' is not allowed"),
    ({"runtime": "ray", "devices.slowdown": "1,0.5,1"},
     "config.devices.slowdown='1,0.5,1' is not allowed; allowed: factors ≥ 1"),
    ({"runtime": "ray", "ray.gpus_per_worker": -1.0}, "config.ray.gpus_per_worker=-1.0"),
    ({"fault.kill_worker": 0}, "config.fault.kill_worker=0 is not allowed; allowed: -1 (off), "
                               "or with runtime='ray'"),
])
def test_bad_ray_settings_fail_before_any_work(overrides, message):
  overrides = dict(overrides)
  with pytest.raises(validation.ConfigError) as error:
    method = overrides.pop("method", "heloco")
    config = tiny.config(method, 3, **{"budget.tokens": 100, **overrides})
    validation.validate(config)
  assert message in str(error.value)
