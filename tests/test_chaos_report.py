"""Issue 35's chaos harness: its grid (experiments/grids.py), its RESULTS.md section
(experiments/chaos.py), and the harness itself at a small scale (slow)."""

import math
import os

import numpy as np
import pytest
import tiny

from experiments import analysis, chaos, grids
from heloco_jax.lm import harness


def test_the_grid_gives_every_method_the_same_schedule_and_the_syncer_to_async_ones():
  runs = grids.grid("chaos")
  assert len(runs) == 3 * (6 * 2 + 4 * 2)
  for condition in ("undisturbed_syncer", "failures_syncer"):
    assert {r.method for r in runs if r.table == condition} == {
        "async_nesterov", "mla", "heloco", "cgad"}
  for seed in (0, 1, 2):
    schedules = {harness.membership(tiny.config(r.method, num_workers=5, **dict(
        (k, v) for k, v in r.overrides if k.startswith(("chaos", "budget", "speeds", "seed",
                                                          "batch", "model.context")))))
        for r in runs if r.seed == seed and r.table.startswith("failures")}
    assert len(schedules) == 1 and next(iter(schedules)).absences  # one, with failures
  assert all(dict(r.overrides)["budget.sim_seconds"] == 400.0 for r in runs)


def _made_up():
  """The chaos grid with known numbers: method i's undisturbed final loss 2 + i/10 (+ seed/100),
  0.05 more under failures, 0.01 and 0.02 more with the syncer (undisturbed, failures);
  goodput 0.9 under failures; each run
  reaches its final loss at t = 100 s (the failures of cgad never do)."""
  out = []
  for run in grids.grid("chaos"):
    i = grids.CHAOS_METHODS.index(run.method)
    extra = {"undisturbed": 0.0, "failures": 0.05, "undisturbed_syncer": 0.01,
             "failures_syncer": 0.02}[run.table]
    final = 2.0 + i / 10 + run.seed / 100 + extra
    late = run.method == "cgad" and run.table == "failures"
    evals = [{"sim_time": 0.0, "val_loss": 5.0},
             {"sim_time": 100.0, "val_loss": 10.0 if late else final},
             {"sim_time": 400.0, "val_loss": final}]
    summary = {"final_val_loss": final, "wall_seconds": 30.0,
               **({"goodput": 0.9} if run.table.startswith("failures") else {})}
    out.append(analysis.Result(run, summary, evals))
  return out


def test_the_section_reports_goodput_time_to_target_and_paired_differences(tmp_path):
  lines = chaos.sections(_made_up(), str(tmp_path / "figures"), str(tmp_path / "RESULTS.md"))
  text = "\n".join(lines)
  assert "60 of 60 runs finished, 0.5 core-hours" in text
  target = 2.0 + 2.5 / 10 + 0.01  # the median of the six undisturbed means
  assert f"Target loss: {target:.3f}" in text
  rows = {tuple(cell.strip() for cell in line.split("|")[1:3]): line
          for line in text.splitlines()
          if line.startswith("| ") and "method" not in line}
  assert "| 0.900 |" in rows[("heloco", "failures")]
  assert "undisturbed: +0.050 [+0.050, +0.050]" in rows[("heloco", "failures")]
  assert "undisturbed_syncer: +0.010" in rows[("mla", "failures_syncer")]
  assert "undisturbed: +0.010" in rows[("mla", "undisturbed_syncer")]
  assert ("ddp", "failures_syncer") not in rows and "| 1.000 |" in rows[("ddp", "undisturbed")]
  assert "| 100 |" in rows[("ddp", "failures")]  # 2.06 at 100 s <= the target
  assert "not reached (0/3)" in rows[("heloco", "failures")]  # 2.46 > the target
  assert "not reached (0/3)" in rows[("cgad", "failures")]
  assert os.path.getsize(tmp_path / "figures" / "chaos.png") > 10_000
  assert chaos.sections([], str(tmp_path), str(tmp_path / "R.md")) == []


@pytest.mark.slow  # 20 small runs, about 4 minutes
def test_the_harness_runs_every_method_under_the_same_failures(tmp_path):
  results = []
  for run in grids.chaos_grid(grids.SMOKE, seeds=(0,)):
    config = tiny.config(run.method, num_workers=5,
                         **{k: v for k, v in run.overrides if k != "method"})
    summary, rows = tiny.simulate(config)
    evals = [r for r in rows if r["event"] == "eval"]
    results.append(analysis.Result(run, summary, evals))
    if not run.table.startswith("failures"):
      assert "goodput" not in summary
      continue
    assert 0 < summary["goodput"] <= 1 and math.isfinite(summary["final_val_loss"])
    assert summary["dispatched_tokens"] == (summary["tokens"] + summary["dropped_tokens"]
                                            + summary["in_flight_tokens"])
    assert [r for r in rows if r["event"] == "left"]  # the schedule did strike
  text = "\n".join(chaos.sections(results, str(tmp_path), str(tmp_path / "R.md")))
  assert text.count("| failures |") == 6 and text.count("| failures_syncer |") == 4
  assert text.count("| undisturbed_syncer |") == 4
  assert np.isfinite(chaos.target(results))
