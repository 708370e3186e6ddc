"""RESULTS.md's streaming sections (experiments/streaming.py) and the shadowed HeLoCo branch
measurement (experiments/branches.py)."""

import asyncio
import json
import os

import jax
import numpy as np
import pytest
import tiny

from experiments import analysis, branches, grids, science, streaming
from heloco_jax.comm import compress


def _result(run, final, peak=1000.0, sent=5000.0, network=2.0, evals=None, arrivals=()):
  evals = evals or [{"tokens": t, "sim_time": float(t), "val_loss": final + 1.0 - t / 100}
                    for t in (0, 50, 100)]
  evals[-1]["val_loss"] = final
  return analysis.Result(run, {"final_val_loss": final, "peak_bytes_per_sync": peak,
                               "bytes_sent": sent, "network_seconds": network,
                               "wall_seconds": 36.0}, evals, list(arrivals))


def _made_up_grid():
  """Every run of the streaming grid with a known final loss: fragments p{P}: 2.0 + P/100
  + seed/1000 with peak 1000/P; compressors: fp32 2.5 + seed/1000, the others 0.01 more;
  bandwidth: final 3.0 − i/10 for the i-th variant, reaching 3.0 at t = 50 s (i = 0: 100 s)."""
  out = []
  bandwidth = [name for name, _, _ in grids.BANDWIDTH_VARIANTS]
  for run in grids.grid("streaming"):
    variant = run.name.split("/")[2]
    if run.table == "fragments":
      p = 4 if variant.startswith("p4") else int(variant[1:])
      out.append(_result(run, 2.0 + p / 100 + run.seed / 1000, peak=1000.0 / p))
    elif run.table == "compression":
      out.append(_result(run, 2.5 + run.seed / 1000 + (variant != "fp32") * 0.01,
                         sent=5000.0 * (0.25 if variant != "fp32" else 1.0),
                         arrivals=[{"branch_count/keep": 3, "branch_count/rotate": 1}]))
    else:
      i = bandwidth.index(variant)
      evals = [{"tokens": 0, "sim_time": 0.0, "val_loss": 4.0},
               {"tokens": 50, "sim_time": 50.0 if i else 100.0, "val_loss": 3.0},
               {"tokens": 100, "sim_time": 200.0, "val_loss": 0.0}]
      out.append(_result(run, 3.0 - i / 10, evals=evals))
  return out


def test_the_sections_report_each_question_from_the_runs(tmp_path):
  results = _made_up_grid()
  lines = streaming.sections(results, str(tmp_path / "figures"), str(tmp_path / "RESULTS.md"))
  text = "\n".join(lines)
  # Fragments: P = 2 is 0.01 above P = 1 on every seed (CI of a constant: no width).
  assert "| p2 | 3 | 2.021 ± 0.001 | +0.010 [+0.010, +0.010] | 500 | 2.00× less | 0.0 MB |" in text
  assert "| p4_overlap | 3 | 2.041 ± 0.001 | +0.030 [+0.030, +0.030] | 250 | 4.00× less |" in text
  # Compression: every compressor 0.01 above fp32, at a quarter of its bytes.
  assert "| heloco (severe) | int4_ef | 3 | 2.511 ± 0.001 | +0.010 [+0.010, +0.010] | 0.250 |" in text
  # Bandwidth: the target is the highest final mean (3.0, the first variant's).
  assert "Target loss: 3.000" in text
  assert f"| {grids.BANDWIDTH_VARIANTS[0][0]} | 3 | 100 | 3.000 ± 0.000 |" in text
  assert f"| {grids.BANDWIDTH_VARIANTS[1][0]} | 3 | 50 | 2.900 ± 0.000 |" in text
  assert "| fp32 | 3 | 0.0% | 75.0% | 0.0% | 25.0% |" in text
  assert "### HeLoCo's branch on the same input, quantized" in text
  assert os.path.getsize(tmp_path / "figures" / "streaming.png") > 10_000
  assert "](figures/streaming.png)" in text
  assert streaming.sections([], str(tmp_path), str(tmp_path / "R.md")) == []


def test_results_md_has_the_streaming_sections_before_the_small_scale_note(tmp_path):
  path = str(tmp_path / "RESULTS.md")
  extra = streaming.sections(_made_up_grid(), str(tmp_path / "figures"), path)
  science.write_results([], path, str(tmp_path / "figures"), "CMD", "NOTE", sections=extra,
                        planned=0)
  text = open(path).read()
  assert text.index("## Streaming and compression") < text.index("## Small scale")
  assert text.index("## Figures") < text.index("## Streaming and compression")


def test_the_branch_table_counts_changed_blocks(tmp_path):
  names = [name for name, _ in branches.SHADOWED]
  assert names == ["bf16", "int8", "int4", "int2", "top1pct"]
  same = np.diag([1, 2, 3, 4]).tolist()  # 10 blocks, none changed
  changed = np.diag([1, 2, 3, 0]).tolist()
  changed[3][1] = 4  # 4 of 10 rotated blocks kept instead
  for seed, pairs in enumerate((same, changed)):
    with open(tmp_path / f"seed{seed}.json", "w") as f:
      json.dump({"pairs": {n: pairs for n in names}}, f)
  table = branches.table(branches.load(str(tmp_path)))
  assert "| int8 | 2 | 20 | 20.0% (0.0–40.0%) | rotate → keep 20.00% |" in table
  assert branches.table([]) == ""


@pytest.mark.slow  # two tiny runs with a shadowed rule; the default suite stays < 15 min
def test_the_shadow_leaves_the_run_as_it_is_and_counts_every_block():
  """The shadowed rule's run is the plain run bit for bit; each arrival adds one pair per
  block and compressor; with compress.none() every block takes the same branch on both."""
  config = tiny.config("heloco", **{"budget.tokens": 640})
  plain, plain_rows = tiny.simulate(config)
  engine = branches.shadowed_engine(config, [compress.none(), compress.int2()],
                                    tiny.dataset(config.num_workers))
  try:
    summary = asyncio.run(engine.run())
    pairs = np.asarray(jax.device_get(engine.outer_state.pairs))
    num_blocks = len(jax.tree.leaves(engine.params))
  finally:
    engine.close()
  assert summary["final_val_loss"] == plain["final_val_loss"]
  assert [r.get("train_loss") for r in engine.rows] == [r.get("train_loss") for r in plain_rows]
  arrivals = sum(r["event"] == "arrival" for r in engine.rows)
  assert pairs.shape == (2, 4, 4)
  assert (pairs.sum(axis=(1, 2)) == arrivals * num_blocks).all() and arrivals > 0
  assert np.trace(pairs[0]) == pairs[0].sum()


def test_a_config_of_a_grid_run_has_its_overrides():
  run = next(r for r in grids.grid("streaming") if "bandwidth/heloco_p4" in r.name)
  config = branches.config_of(run, {"compression.kind": "int4"})
  assert config.streaming.fragments == 4 and config.comm.bandwidth == grids.STREAMING_BANDWIDTH
  assert config.compression.kind == "int4" and config.compression.error_feedback
