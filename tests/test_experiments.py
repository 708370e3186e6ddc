"""The reproduction grid: its runs, budgets and flags, and the smoke grid end to end."""

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from experiments import analysis, grids, reproduce


def test_paper_grid_is_every_preset_method_and_seed_at_both_budgets():
  runs = grids.grid("paper")
  assert len(runs) == 2 * 4 * 5 * 3
  assert len({r.name for r in runs}) == len(runs)
  assert {(r.table, r.preset, r.method, r.seed) for r in runs} == {
      (t, p, m, s) for t in ("tokens", "time") for p in grids.PRESETS
      for m in grids.METHODS for s in (0, 1, 2)}
  for run in runs:  # one tuned inner learning rate and the method's own outer defaults for all
    keys = dict(run.overrides)
    assert keys["inner.learning_rate"] == grids.PAPER.inner_learning_rate
    assert "outer.learning_rate" not in keys
    assert keys["data.source"] == "text_dir" and keys["data.languages"] == "de,en,es,fr,it"


def test_time_budget_is_the_time_non_waiting_workers_need_for_the_token_budget():
  scale = grids.PAPER
  # severe: 1 + 4/15 steps per simulated second over the 5 workers.
  expected = scale.tokens / (scale.batch_size * scale.context * (1 + 4 / 15))
  assert grids.time_budget(scale, "severe") == pytest.approx(expected, rel=1e-12)
  homogeneous = grids.time_budget(scale, "homogeneous")
  assert homogeneous == pytest.approx(scale.tokens / (scale.batch_size * scale.context * 5))
  for run in grids.grid("paper"):
    keys = dict(run.overrides)
    if run.table == "time":
      assert keys["budget.tokens"] == 0
      assert keys["budget.sim_seconds"] == grids.time_budget(scale, run.preset)
    else:
      assert keys["budget.tokens"] == scale.tokens and keys["budget.sim_seconds"] == 0


def test_run_args_are_train_flags_and_take_the_corpus_path():
  run = grids.grid("paper")[0]
  args = run.args("/data/corpus")
  assert "--config.data.path=/data/corpus" in args
  assert f"--config.method={run.method}" in args and "--config.speeds=homogeneous" in args
  assert all(a.startswith("--config.") for a in args)


def test_unknown_grid_is_refused():
  with pytest.raises(ValueError, match="--grid='huge' is not allowed; allowed: paper, smoke, tune, palsgd, ablations, all, authors, authors_lr, palsgd_c, palsgd_why, decay_why, dn_tuned, science, jitter, lr_sweep, vocab, heldout, palsgd_fair, skeptic"):
    grids.grid("huge")


def test_all_grid_is_every_paper_scale_grid_once_tuning_first():
  runs = grids.grid("all")
  names = [r.name for r in runs]
  assert len(set(names)) == len(names) == 6 + 120 + 9 + 15
  for name in ("tune", "paper", "palsgd", "ablations"):
    assert {r.name for r in grids.grid(name)} <= set(names)
    assert grids.family(name) == runs  # RESULTS.md of any of them reports them all
  assert all(r.table == "tune" for r in runs[:6])
  assert grids.family("smoke") == grids.grid("smoke")


def test_improvement_is_relative_to_the_baseline():
  assert analysis._improvement(4.0, 3.0) == pytest.approx(25.0)
  assert analysis._improvement(3.0, 3.3) == pytest.approx(-10.0)


@pytest.mark.slow  # 50–120 s: the default suite stays under 15 minutes
def test_smoke_grid_runs_writes_results_and_skips_finished_runs(tmp_path, capsys):
  out = str(tmp_path / "out")
  assert reproduce.main(["--grid=smoke", f"--out={out}", "--jobs=1"]) == 0
  results_md = open(os.path.join(out, "RESULTS.md")).read()
  for heading in ("## Fixed token budget", "## Fixed wall-clock (simulated) budget",
                  "## Per-language validation loss", "HeLoCo vs mla", "up to 7.5%"):
    assert heading in results_md
  for figure in ("loss_vs_tokens.png", "loss_vs_sim_time.png", "staleness_per_worker.png",
                 "alignment_over_time.png", "heloco_branches.png"):
    path = os.path.join(out, "figures", figure)
    assert os.path.getsize(path) > 10_000 and f"figures/{figure}" in results_md
  results = analysis.load(out, grids.grid("smoke"))
  assert len(results) == 20
  for r in results:
    assert np.isfinite(r.summary["final_val_loss"])
    assert r.summary["final_val_loss"] < r.summary["initial_val_loss"]
    if r.run.table == "time":
      assert r.summary["sim_time"] <= grids.time_budget(grids.SMOKE, r.run.preset)
  # The table's cells are the runs' own numbers.
  heloco = [r for r in results if (r.run.table, r.run.preset, r.run.method) == (
      "tokens", "severe", "heloco")][0]
  assert f"{heloco.summary['final_val_loss']:.4f} ± 0.0000 (n=1)" in results_md
  # Synchronous DiLoCo waits for the slow workers: fewer tokens in the same simulated time.
  time_tokens = {r.run.method: r.summary["tokens"] for r in results
                 if (r.run.table, r.run.preset) == ("time", "severe")}
  assert time_tokens["diloco"] < 0.5 * time_tokens["heloco"]
  capsys.readouterr()
  assert reproduce.main(["--grid=smoke", f"--out={out}"]) == 0  # everything is finished
  err = capsys.readouterr().err
  assert "20 runs, 20 already finished" in err and "heloco-jax train" not in err


def test_tune_table_marks_the_lowest_loss():
  runs = grids.tune_grid(grids.SMOKE)
  results = [analysis.Result(run, {"final_val_loss": loss}, [])
             for run, loss in zip(runs, (3.0, 2.5, 2.7, 2.9, 3.1, 3.3))]
  table = analysis.tune_table(results)
  assert "| **0.0006** | 2.5000 |" in table and "| 0.0003 | 3.0000 |" in table
  assert table.count("**") == 2


def test_time_to_loss_interpolates_between_evals():
  evals = [{"sim_time": 0.0, "val_loss": 5.0}, {"sim_time": 10.0, "val_loss": 3.0},
           {"sim_time": 20.0, "val_loss": 2.0}]
  assert analysis.time_to_loss(evals, 2.5) == pytest.approx(15.0)
  assert analysis.time_to_loss(evals, 3.0) == pytest.approx(10.0)
  assert analysis.time_to_loss(evals, 1.0) == float("inf")
  assert analysis.time_to_loss(evals, 6.0) == 0.0


def test_ablation_grid_varies_one_thing_of_the_severe_token_runs():
  runs = grids.grid("ablations")
  assert len({r.name for r in runs}) == len(runs) == 15
  paper = {(r.method, r.seed): dict(r.overrides) for r in grids.grid("paper")
           if (r.table, r.preset) == ("tokens", "severe")}
  for run in runs:
    keys = dict(run.overrides)
    base = paper[(run.method, run.seed)]
    changed = {k for k in keys if keys[k] != base.get(k)}
    ablation, variant = run.table.split("/")[1:]
    expected = dict((v, c) for v, _, c in grids.ABLATIONS[ablation])[variant]
    assert changed == set(expected), (run.name, changed)


def _result(table, preset, method, seed, loss, arrivals=()):
  run = grids.Run(f"{table}/{preset}/{method}/seed{seed}", table, preset, method, seed, ())
  return analysis.Result(run, {"final_val_loss": loss}, [], list(arrivals))


def test_ablation_table_compares_each_variant_with_its_paper_grid_run():
  results = [_result("tokens", "severe", "heloco", s, loss) for s, loss in enumerate((3.0, 3.2))]
  results += [_result("ablation/weight_order/after", "severe", "heloco", s, loss)
              for s, loss in enumerate((3.3, 3.3))]
  table = analysis.ablation_table(results)
  assert "| weight_order | after | heloco | 3.3000 ± 0.0000 (n=2) | 3.1000 ± 0.1000 |" in table
  assert "+6.45%" in table  # (3.3 − 3.1) / 3.1: the variant's loss is higher


def test_update_share_counts_each_workers_arrivals_staleness_and_corrections():
  def arrival(worker, tau, shrink, rotate):
    return {"worker": worker, "staleness": tau, "branch_count/pass": 0,
            "branch_count/keep": 4 - shrink - rotate, "branch_count/shrink": shrink,
            "branch_count/rotate": rotate}
  arrivals = [arrival(0, 0, 0, 0), arrival(0, 1, 0, 0), arrival(0, 0, 1, 0),
              arrival(1, 3, 1, 1), arrival(4, 2, 0, 0)]
  table = analysis.update_share_table([_result("tokens", "severe", "heloco", 0, 3.0, arrivals)])
  assert "| severe | 0 | 60.0% | 0.33 | 8.3% |" in table
  assert "| severe | 1 | 20.0% | 3.00 | 50.0% |" in table
  assert "| severe | 2 | 0.0% | nan | 0.0% |" in table
  assert "| severe | 4 | 20.0% | 2.00 | 0.0% |" in table


def test_compare_says_whether_the_difference_is_beyond_seed_noise():
  clear = [_result("time", "severe", "heloco", s, x) for s, x in enumerate((3.0, 3.01, 2.99))]
  clear += [_result("time", "severe", "diloco", s, x) for s, x in enumerate((4.0, 4.01, 3.99))]
  improvement, beyond = analysis.compare(clear, "time", "severe", "diloco")
  assert improvement == pytest.approx(25.0) and beyond
  noisy = [_result("time", "severe", "heloco", s, x) for s, x in enumerate((3.0, 3.5, 2.5))]
  noisy += [_result("time", "severe", "mla", s, x) for s, x in enumerate((3.1, 3.6, 2.6))]
  improvement, beyond = analysis.compare(noisy, "time", "severe", "mla")
  assert improvement == pytest.approx(100 * 0.1 / 3.1) and not beyond
  assert analysis.compare(noisy, "time", "mild", "mla") is None


def test_claims_table_reports_the_best_comparison_and_the_losses():
  results = [_result("tokens", p, m, s, loss + 0.001 * s) for p, m, loss in (
      ("mild", "heloco", 3.0), ("mild", "async_nesterov", 3.3), ("mild", "delayed_nesterov", 2.9),
      ("severe", "heloco", 3.0), ("severe", "async_nesterov", 3.1)) for s in range(3)]
  claims = analysis.claims_table(results)
  row = next(line for line in claims.splitlines() if "async DiLoCo" in line)
  assert "+9.09% (mild, vs async_nesterov, beyond seed noise)" in row
  assert "HeLoCo lower in 2 of 3; beyond noise: 2 better, 1 worse" in row
  assert "| HeLoCo vs MLA, wall-clock budget | up to +3.3% | – | – |" in claims


def test_palsgd_table_times_each_seed_to_its_ddp_loss_and_marks_a_target_never_reached():
  def run(method, seed, losses):
    r = _result("palsgd", "homogeneous", method, seed, losses[-1])
    r.summary["tokens"] = 1000
    r.evals = [{"sim_time": 100.0 * i, "val_loss": x} for i, x in enumerate(losses)]
    return r
  results = [run("ddp", 0, (5.0, 3.0, 2.0)), run("palsgd", 0, (5.0, 2.0, 1.5)),
             run("ddp", 1, (5.0, 3.0, 3.0)), run("palsgd", 1, (5.0, 3.0, 2.0)),
             run("diloco", 0, (5.0, 4.0, 3.0))]
  # DDP reaches its own final loss at 200 s (seed 0) and 100 s (seed 1), 150 s on average;
  # PALSGD reaches those same targets at 100 s in both seeds: (150 − 100) / 150 = 33.3%.
  assert analysis.palsgd_speedups(results)["palsgd"] == pytest.approx(100 * (150 - 100) / 150)
  assert analysis.palsgd_speedups(results)["diloco"] == -np.inf
  table = analysis.palsgd_table(results)
  assert "| palsgd | 1,000 | 1.7500 ± 0.2500 | 100 | +33.3% |" in table
  assert "| diloco | 1,000 | 3.0000 ± 0.0000 | not reached in 1 of 1 seeds | – |" in table
  assert "diloco: DDP's loss not reached" in analysis.claims_table(results)


def test_authors_grid_mirrors_the_authors_harness():
  runs = grids.grid("authors")
  tokens = [r for r in runs if r.table == "tokens"]
  assert {(r.preset, r.method, r.seed) for r in tokens} == {
      (p, m, s) for p in grids.AUTHORS_PRESETS for m in grids.METHODS for s in (0, 1, 2)
      if m != "diloco" or p == "homogeneous"}  # sync: one token trajectory at all paces
  time_runs = [r for r in runs if r.table == "time"]  # homogeneous: no one waits
  assert {(r.preset, r.method) for r in time_runs} == {
      (p, "diloco") for p in grids.AUTHORS_PRESETS if p != "homogeneous"}
  for run in runs:
    keys = dict(run.overrides)
    assert (keys["model.d_model"], keys["model.num_layers"], keys["model.num_heads"],
            keys["model.context"], keys["batch_size"], keys["inner_steps"]) == (
                128, 8, 4, 128, 2, 20)
    assert keys["inner.learning_rate"] == 2e-4 and keys["inner.warmup_steps"] == 0
    assert keys["inner.learning_rate"] * keys["inner.min_learning_rate_ratio"] == (
        pytest.approx(1e-6))
    assert (keys["inner.weight_decay"], keys["inner.grad_clip"],
            keys["inner.reset_optimizer"]) == (1e-2, 0.0, True)
    assert "outer.learning_rate" not in keys  # the registry's defaults are the authors'
    if run.table == "tokens":
      assert keys["budget.tokens"] == 10_000 * 256
      # Evaluations fall on 25%, 50% and 100% of the budget.
      assert all((f * keys["budget.tokens"]) % keys["budget.eval_every_tokens"] == 0
                 for f in grids.BUDGET_FRACTIONS)
    else:
      assert keys["budget.sim_seconds"] == grids.time_budget(grids.AUTHORS, run.preset)
  args = runs[0].args("/data/corpus")
  assert "--config.data.tokenizer=/data/corpus/tokenizer.json" in args
  assert "--config.data.path=/data/corpus" in args


def test_authors_lr_grid_scales_each_methods_default():
  from heloco_jax.training import methods
  runs = grids.grid("authors_lr")
  assert len(runs) == len(grids.METHODS) * len(grids.LR_FACTORS) + sum(
      map(len, grids.LR_EDGE_FACTORS.values()))
  assert {r.name for r in runs} >= {"authors/lr/delayed_nesterov/x4",
                                    "authors/lr/delayed_nesterov/x8", "authors/lr/mla/x2"}
  for run in runs:
    factor = float(run.name.rsplit("/x", 1)[1])
    assert dict(run.overrides)["outer.learning_rate"] == pytest.approx(
        methods.get(run.method).learning_rate * factor)


def test_palsgd_c_grid_runs_every_ratio_with_the_authors_pull():
  runs = grids.grid("palsgd_c")
  assert len(runs) == 3 * (4 * len(grids.COMM_RATIOS) - 1)
  for run in runs:
    keys = dict(run.overrides)
    assert keys["data.partition"] == "iid" and keys["comm.latency"] in grids.COMM_RATIOS
    if run.method == "palsgd":
      pull = (keys["inner.pseudo_sync_rate"] * keys["inner.learning_rate"]
              / keys["inner.pseudo_sync_prob"])
      assert pull == pytest.approx(0.05) and keys["outer.learning_rate"] == 0.1
      assert keys["inner.palsgd_coins"] == "shared"
    assert keys.get("comm.ddp_overlap", 0) == (grids.DDP_OVERLAP if run.method == "ddp_overlap"
                                               else 0)


def test_palsgd_why_grid_swaps_only_the_outer_lr_of_palsgd_and_diloco():
  """Each run equals its palsgd_c run (same c, seed) but for the outer learning rate: PALSGD
  at DiLoCo's at every c, DiLoCo at PALSGD's at c = PALSGD_WHY_C."""
  c_runs = {r.name: dict(r.overrides) for r in grids.grid("palsgd_c")}
  runs = grids.grid("palsgd_why")
  assert [r.name for r in runs] == [
      name for s in (0, 1, 2) for name in
      [f"palsgd_c/c{c:g}/palsgd_lr0.7/seed{s}" for c in grids.COMM_RATIOS]
      + [f"palsgd_c/c{grids.PALSGD_WHY_C:g}/diloco_lr0.1/seed{s}"]]
  for run in runs:
    keys = dict(run.overrides)
    same = c_runs[run.name.replace(run.method, run.method.split("_")[0])]
    assert {k: v for k, v in keys.items() if k != "outer.learning_rate"} == {
        k: v for k, v in same.items() if k != "outer.learning_rate"}
    assert keys["outer.learning_rate"] == {"palsgd": 0.7, "diloco": 0.1}[keys["method"]]
    assert same.get("outer.learning_rate", 0.7) == {"palsgd": 0.1, "diloco": 0.7}[keys["method"]]


def test_decay_why_grid_changes_only_the_inner_lr_schedule_of_helocos_and_syncs_severe_runs():
  """Each run is the authors grid's run of its name (HeLoCo's token run, synchronous DiLoCo's
  time run, severe paces) with the inner cosine decay over the fast worker's steps in T
  (long_decay) or with a constant inner lr (no_decay)."""
  authors = {r.name: dict(r.overrides) for r in grids.grid("authors")}
  runs = grids.grid("decay_why")
  assert [r.name for r in runs] == [
      f"authors/{variant}/{name}/seed{s}" for s in (0, 1, 2)
      for name in ("tokens/severe/heloco", "time/severe/diloco")
      for variant in ("long_decay", "no_decay")]
  # severe: 1 s and four 15 s steps; T = 2,560,000 tokens / (256 tokens × (1 + 4/15) steps/s)
  assert grids.fastest_worker_steps(grids.AUTHORS, "severe") == round(10_000 / (1 + 4 / 15))
  changed = {"long_decay": {"inner.total_steps": 7_895},
             "no_decay": {"inner.min_learning_rate_ratio": 1.0}}
  for run in runs:
    keys = dict(run.overrides)
    same = authors[run.name.replace(f"{run.table}/", "", 1)]
    assert same["inner.total_steps"] == 2_000 and same["inner.min_learning_rate_ratio"] == pytest.approx(1e-6 / 2e-4)
    assert {k: v for k, v in keys.items() if v != same[k]} == changed[run.table]


def test_science_grid_finishes_seed_by_seed():
  runs = grids.grid("science")
  names = [r.name for r in runs]
  # per seed: 5 paces × 4 async methods, 1 sync token run, 4 sync time runs, 23 PALSGD-vs-c
  # runs, 7 of the outer-lr swap and 4 of the inner lr schedule; then the lr check (5 methods
  # × 3 factors, and DN × 4, 8, 16, 32), and DN at its tuned lr (5 paces × 3 seeds)
  assert len(set(names)) == len(names) == 3 * (5 * 4 + 1 + 4 + 23 + 7 + 4) + 15 + 4 + 15
  seeds = [r.seed for r in runs if r.table not in ("lr", "dn_tuned")]
  assert seeds == sorted(seeds)
  assert all(r.table == "lr" for r in runs[-34:-15])  # the one-seed lr check
  assert all(r.table == "dn_tuned" for r in runs[-15:])
  assert [r.seed for r in runs[-15:]] == sorted(r.seed for r in runs[-15:])
  for name in grids.SCIENCE:  # one RESULTS.md for issues 18, 36, 34, 35, 60, 81 and 80
    assert grids.family(name) == list(dict.fromkeys(
        runs + grids.grid("skeptic") + grids.grid("streaming") + grids.grid("cgad_lr")
        + grids.grid("cgad") + grids.grid("chaos") + grids.grid("symmetric")
        + grids.grid("scale") + grids.grid("body") + grids.grid("palsgd8m")
        + grids.grid("faulty") + grids.grid("merge_order")))


def test_dn_tuned_grid_changes_only_delayed_nesterovs_outer_lr():
  authors = {r.name: r for r in grids.grid("authors")}
  runs = grids.grid("dn_tuned")
  assert len(runs) == 5 * 3 and {r.method for r in runs} == {"delayed_nesterov"}
  for run in runs:
    same = dict(authors[run.name.replace("authors/dn_tuned/", "authors/", 1)].overrides)
    keys = dict(run.overrides)
    assert {k: v for k, v in keys.items() if v != same.get(k)} == {
        "outer.learning_rate": pytest.approx(0.07 * 16)}


def test_jitter_grid_is_the_claims_runs_at_severe_and_moderate_with_jitter_seed_by_seed():
  """Issue 36, item 2: each run is the authors grid's run of its name (async methods' token
  runs, synchronous DiLoCo's time runs) with only the jitter changed, in its own tables."""
  authors = {r.name: dict(r.overrides) for r in grids.authors_grid(seeds=range(5))}
  runs = grids.grid("jitter")
  # 3 seeds, then seeds 3 and 4 of the cell whose CI crossed zero (severe, HeLoCo vs async N)
  assert [r.name for r in runs] == [
      f"skeptic/jitter/{name}/seed{s}" for s in (0, 1, 2) for p in ("severe", "moderate")
      for name in (f"tokens/{p}/async_nesterov", f"tokens/{p}/delayed_nesterov",
                   f"tokens/{p}/mla", f"tokens/{p}/heloco", f"time/{p}/diloco")] + [
          f"skeptic/jitter/tokens/severe/{m}/seed{s}" for s in (3, 4)
          for m in ("async_nesterov", "heloco")]
  assert 0 < grids.JITTER < 1 and authors[next(iter(authors))].get("jitter") is None
  for run in runs:
    keys = dict(run.overrides)
    same = authors[run.name.replace("skeptic/jitter/", "authors/", 1)]
    assert {k: v for k, v in keys.items() if v != same.get(k)} == {"jitter": grids.JITTER}
    assert run.table == f"jitter/{same['budget.tokens'] and 'tokens' or 'time'}"
    assert run.args().count(f"--config.jitter={grids.JITTER}") == 1
  # the authors grid's tables never read them
  from experiments import science  # pylint: disable=g-import-not-at-top
  results = [analysis.Result(r, {"final_val_loss": 1.0}, [], []) for r in runs]
  assert science._authors(results) == []  # pylint: disable=protected-access


def test_lr_sweep_grid_changes_only_the_outer_lr_of_the_jitter_runs_seed_0_first(monkeypatch):
  """Issue 36, item 3: on seed 0 every method's outer lr × 0.5 and 2 (DN also × 4, 8 and 16;
  MLA and HeLoCo also × 0.25) at severe and moderate paces; seeds 1 and 2 at seed 0's best
  only; × 1 is the jitter grid's."""
  from heloco_jax.training import methods  # pylint: disable=g-import-not-at-top
  jitter = {r.name: dict(r.overrides) for r in grids.grid("jitter")}
  monkeypatch.setattr(grids, "SKEPTIC_LR_BEST", {})
  runs = grids.grid("lr_sweep")
  assert len(runs) == len({r.name for r in runs}) == 2 * (5 * 2 + 3 + 2)
  assert {r.seed for r in runs} == {0}  # no best known yet: no later seeds
  for run in runs:
    method_dir, factor = run.name.split("/")[-3:-1]
    assert method_dir == run.method and factor.startswith("x")
    keys = dict(run.overrides)
    same = jitter[run.name.replace("skeptic/lr/", "skeptic/jitter/", 1).replace(
        f"/{factor}/", "/")]
    assert {k: v for k, v in keys.items() if v != same.get(k)} == {
        "outer.learning_rate": pytest.approx(methods.get(run.method).learning_rate
                                             * float(factor[1:]))}
    assert run.table == "lr/" + ("time" if run.method == "diloco" else "tokens")
  factors = {r.name.split("/")[-2] for r in runs if r.method == "delayed_nesterov"}
  assert factors == {"x0.5", "x2", "x4", "x8", "x16"}
  for method in ("mla", "heloco"):
    assert [r.name.split("/")[-2] for r in runs if r.method == method] == [
        "x0.25", "x0.5", "x2"] * 2
  # Once seed 0's bests are known, seeds 1 and 2 run there (× 1: the jitter runs, none here).
  monkeypatch.setattr(grids, "SKEPTIC_LR_BEST", {("severe", "mla"): 2.0,
                                                 ("moderate", "heloco"): 1.0})
  later = [r.name for r in grids.grid("lr_sweep") if r.seed != 0]
  # ... and the ``LR_UNCLEAR`` cells at their best on seeds 3 and 4 (HeLoCo's × 1: none).
  assert grids.LR_UNCLEAR == (("severe", ("heloco", "mla")),)
  assert later == [f"skeptic/lr/tokens/severe/mla/x2/seed{s}" for s in (1, 2, 3, 4)]


def test_vocab_grid_changes_only_the_vocabulary_of_the_claims_runs_at_severe_and_mixed():
  """Issue 36, item 4: the authors grid's runs (HeLoCo, MLA, async Nesterov token runs, sync
  DiLoCo's time runs and its one token run) with a 50,257-id BPE, jitter 0 as there."""
  authors = {r.name: dict(r.overrides) for r in grids.grid("authors")}
  runs = grids.grid("vocab")
  per_seed = ["tokens/homogeneous/diloco"] + [
      f"{t}/{p}/{m}" for p in ("severe", "mixed")
      for t, m in (("tokens", "async_nesterov"), ("tokens", "mla"), ("tokens", "heloco"),
                   ("time", "diloco"))]
  assert [r.name for r in runs] == [f"skeptic/vocab50257/{name}/seed{s}" for s in (0, 1, 2)
                                    for name in per_seed]
  for run in runs:
    keys = dict(run.overrides)
    same = authors[run.name.replace("skeptic/vocab50257/", "authors/", 1)]
    assert same["data.tokenizer"] == "{corpus}/tokenizer.json"
    assert {k: v for k, v in keys.items() if v != same.get(k)} == {
        "data.tokenizer": "{corpus}/tokenizer_50257.json"}
    assert run.args("/c").count("--config.data.tokenizer=/c/tokenizer_50257.json") == 1
  assert reproduce.corpus_vocabularies(runs[:1]) == {"tokenizer_50257.json": 50_257}
  assert reproduce.corpus_vocabularies(grids.grid("jitter") + runs) == {
      "tokenizer.json": 2048, "tokenizer_50257.json": 50_257}
  assert reproduce.corpus_vocabularies(grids.grid("palsgd_c")) == {}


def test_heldout_grid_is_the_jitter_grid_on_other_languages_from_their_own_corpus():
  """Issue 36, item 6: five languages the grid does not use, their own corpus folder next to
  the grid's and their own 2,048-id BPE; seeds 3 and 4 of the cells whose CI crossed zero."""
  jitter = {r.name: dict(r.overrides) for r in grids.jitter_grid(seeds=range(5))}
  runs = grids.grid("heldout")
  assert len(runs) == 30 + 10 and not set(grids.HELDOUT_LANGUAGES.split(",")) & set(
      grids.LANGUAGES.split(","))
  assert [r.name for r in runs[30:]] == [
      f"skeptic/heldout/tokens/{preset}/{method}/seed{seed}" for seed in (3, 4)
      for preset, methods in (("moderate", ("mla", "heloco")),
                              ("severe", ("async_nesterov", "mla", "heloco")))
      for method in methods]
  for run in runs:
    keys = dict(run.overrides)
    same = jitter[run.name.replace("skeptic/heldout/", "skeptic/jitter/", 1)]
    assert {k: v for k, v in keys.items() if v != same.get(k)} == {
        "data.languages": "nl,pt,sv,pl,fi", "data.path": "{corpus}_heldout",
        "data.tokenizer": "{corpus}_heldout/tokenizer.json"}
    args = run.args("/c/corpus")
    assert "--config.data.path=/c/corpus_heldout" in args
    assert "--config.data.tokenizer=/c/corpus_heldout/tokenizer.json" in args
  assert reproduce.extra_corpora(runs + grids.grid("jitter")) == ["_heldout"]
  assert reproduce.corpus_vocabularies(runs) == {}
  assert "--config.data.path=/c/corpus" in grids.grid("jitter")[0].args("/c/corpus")


def test_palsgd_fair_grid_tunes_ddp_for_its_own_run_and_sweeps_palsgds_outer_lr_and_pull(
    monkeypatch):
  """Issue 36, item 5: the palsgd_c runs with only DDP's decay span and lr, or PALSGD's outer
  lr and pull, changed; seeds 1 and 2 at seed 0's best only."""
  c_runs = {r.name: dict(r.overrides) for r in grids.grid("palsgd_c")}
  monkeypatch.setattr(grids, "PALSGD_FAIR_BEST", None)
  runs = grids.grid("palsgd_fair")
  assert grids.ddp_own_steps() == 781  # 1M tokens / (5 workers × 4 × 64)
  ddp = [r for r in runs if dict(r.overrides)["method"] == "ddp"]
  palsgd = [r for r in runs if dict(r.overrides)["method"] == "palsgd"]
  assert len(ddp) == 5 * 6 + 2 * (5 + 5) and len(palsgd) == 4 * 4 - 2 + 3
  assert {r.name.split("/")[-2] for r in ddp if r.seed and r.table != "palsgd_fair/c0"} == {
      "ddp_own_decay_x5"}
  assert sum(r.table == "palsgd_fair/c0" for r in ddp) == 3 * 5
  assert {r.seed for r in palsgd} == {0}  # no best known yet: no later seeds
  assert len({r.name for r in runs}) == len(runs) and [r.seed for r in runs] == sorted(
      r.seed for r in runs)
  for run in ddp:
    keys = dict(run.overrides)
    c = run.table.split("/c")[1]
    same = c_runs[f"palsgd_c/c{c}/ddp/seed{run.seed}"]
    changed = {k: v for k, v in keys.items() if v != same.get(k)}
    assert changed["inner.total_steps"] == 781 and set(changed) <= {
        "inner.total_steps", "inner.learning_rate"}
    assert keys["inner.learning_rate"] / 6e-4 == pytest.approx(
        float(run.name.split("_x")[1].split("/")[0]), rel=3e-3)
  lrs = {(dict(r.overrides)["outer.learning_rate"],
          round(dict(r.overrides)["inner.pseudo_sync_rate"] * 6e-4 / 0.2, 6)) for r in palsgd}
  assert len(lrs) == 17 and (0.1, 0.05) not in lrs and (0.7, 0.05) not in lrs
  assert {(1.0, 0.4), (1.4, 0.2), (1.4, 0.4)} <= lrs
  for run in palsgd:
    keys = dict(run.overrides)
    same = c_runs[f"palsgd_c/c0.25/palsgd/seed{run.seed}"]
    assert set(k for k, v in keys.items() if v != same.get(k)) <= {
        "outer.learning_rate", "inner.pseudo_sync_rate"}
    assert run.name.startswith("skeptic/palsgd_fair/c0.25/palsgd_lr")
  monkeypatch.setattr(grids, "PALSGD_FAIR_BEST", (0.7, 0.2))
  later = [r.name for r in grids.grid("palsgd_fair") if r.seed and "palsgd_lr" in r.name]
  assert later == [f"skeptic/palsgd_fair/c0.25/palsgd_lr0.7_pull0.2/seed{s}" for s in (1, 2)]


def test_skeptic_grid_runs_the_most_answer_per_core_hour_first():
  runs = grids.grid("skeptic")
  names = [r.name for r in runs]
  lr_later = len(grids.grid("lr_sweep")) - 30
  fair = len(grids.grid("palsgd_fair"))
  assert fair in (47 + 2 * 10, 47 + 2 * 11)  # seed 0's sweep, the bests (once known) on 1, 2
  assert len(set(names)) == len(names) == 30 + fair + 4 + 30 + 30 + 10 + 3 * 9 + lr_later
  seed0 = lambda g: [r for r in grids.grid(g) if r.seed == 0]
  later = lambda g: [r for r in grids.grid(g) if r.seed in (1, 2)]
  more = lambda g: [r for r in grids.grid(g) if r.seed in (3, 4)]
  sync_question = [f"skeptic/vocab50257/{t}/severe/{m}/seed{s}" for s in (0, 1, 2)
                   for t, m in (("tokens", "heloco"), ("time", "diloco"))]
  no_claim = [r for r in grids.grid("vocab") if "/tokens/homogeneous/diloco/" in r.name]
  assert len(no_claim) == 3 and names[-3:] == [r.name for r in no_claim]
  at = 30 + fair + 4 + 30 + 10
  assert names[at:at + 6] == sync_question
  jitter = grids.grid("jitter")
  assert runs == (jitter[:30] + grids.grid("palsgd_fair") + jitter[30:] + seed0("lr_sweep")
                  + seed0("heldout") + runs[at:at + 6] + later("heldout") + later("lr_sweep")
                  + more("heldout") + more("lr_sweep")
                  + [r for r in grids.grid("vocab") if r not in runs[at:at + 6] + no_claim]
                  + no_claim)
  assert grids.ONE_REPORT == (*grids.SCIENCE, *grids.SKEPTIC, "streaming", *grids.ISSUE35,
                              *grids.ISSUE60, *grids.ISSUE81, *grids.ISSUE80)
  for name in grids.ONE_REPORT:
    family = grids.family(name)
    assert family == list(dict.fromkeys(
        grids.grid("science") + runs + grids.grid("streaming") + grids.grid("cgad_lr")
        + grids.grid("cgad") + grids.grid("chaos") + grids.grid("symmetric")
        + grids.grid("scale") + grids.grid("body") + grids.grid("palsgd8m")
        + grids.grid("faulty") + grids.grid("merge_order")))
    assert len(family) == len(set(family))  # the symmetric grid's runs of other grids once


def test_time_left_comes_from_finished_runs_training_time_also_those_of_earlier_commands():
  runs = [r for r in grids.grid("authors") if r.seed == 0 and r.table == "tokens"]
  tokens = reproduce.expected_tokens(runs[0])
  assert tokens == 2_560_000 and all(reproduce.expected_tokens(r) == tokens for r in runs)
  # Nothing timed: no guess.
  assert reproduce.Progress(runs[2:], jobs=2).eta() == "time left unknown"
  # Two runs finished before this command, 900 s and 700 s (a 0 from an old summary is
  # skipped): 800 s a run, 2 at a time.
  progress = reproduce.Progress(runs[3:7], jobs=2,
                                timed=[(runs[0], 900.0), (runs[1], 700.0), (runs[2], 0.0)])
  assert progress.eta() == "about 27 min left"  # 4 × 800 / 2 s
  # A run resumed by this command reports its summary's training time, all parts together;
  # this command's runs (this machine's) then set the rate of their shape.
  progress.finished(runs[3], 1100.0)
  assert progress.eta() == "about 28 min left"  # 3 × 1100 / 2 s
  assert (progress.done, progress.total) == (1, 4)
  # A shape not timed yet is counted apart.
  palsgd = next(r for r in grids.grid("palsgd_c") if r.method == "palsgd")
  assert "(+ 1 runs of a size not timed yet)" in reproduce.Progress(
      [*runs[3:5], palsgd], jobs=2, timed=[(runs[0], 800.0)]).eta()


def test_a_run_starts_only_if_the_finished_runs_of_its_size_say_it_ends_by_the_deadline(
    monkeypatch, capsys):
  """--deadline on a machine leased until a known time: the first queued run expected to end
  by it starts (its shape's seconds per token × its tokens, and START_SECONDS); none, once no
  run fits or the deadline has passed; a shape not timed yet starts while it has not."""
  monkeypatch.setattr(reproduce.time, "monotonic", lambda: 1000.0)
  runs = grids.grid("palsgd8m")
  ddp = next(r for r in runs if r.method.startswith("ddp"))
  palsgd = next(r for r in runs if r.method.startswith("palsgd"))  # twice DDP's tokens
  assert reproduce.expected_tokens(palsgd) == 2 * reproduce.expected_tokens(ddp)
  progress = reproduce.Progress([palsgd, ddp], jobs=1, timed=[(ddp, 1000.0)])
  assert progress.training_seconds(palsgd) == pytest.approx(2000.0)
  start = reproduce.START_SECONDS
  queue = [palsgd, ddp]
  assert reproduce.next_fitting(queue, progress, 1000.0 + start + 2000.0) == 0
  assert reproduce.next_fitting(queue, progress, 1000.0 + start + 1999.0) == 1
  assert reproduce.next_fitting(queue, progress, 1000.0 + start + 999.0) is None
  assert reproduce.next_fitting(queue, progress, 999.0) is None  # passed
  assert reproduce.next_fitting(queue, progress, float("inf")) == 0
  other = grids.grid("authors")[0]  # a shape nobody timed: starts while the deadline is ahead
  assert reproduce.next_fitting([other, ddp], progress, 1001.0) == 0
  assert reproduce.next_fitting([other, ddp], progress, 999.0) is None
  reproduce._start_first(queue, 1, progress)
  reproduce._left_for_later(queue, 1000.0 + 600.0)
  err = capsys.readouterr().err
  assert f"{palsgd.name} would end after --deadline (about 34 min): {ddp.name} starts" in err
  assert ("--deadline in 10 min, which no queued run is expected to end by: 2 runs not "
          f"started ({palsgd.name} next)") in err
  # A run this command finishes (this machine's) sets its shape's rate from then on.
  progress.finished(ddp, 1500.0)
  assert progress.training_seconds(palsgd) == pytest.approx(3000.0)
  # Until then from the model's DDP runs; once a PALSGD run is timed, from its own loop's
  # (a palsgd8m PALSGD run costs 1.2–1.5× DDP's seconds per token: experiments/README.md).
  progress.finished(palsgd, 4350.0)
  assert progress.training_seconds(palsgd) == pytest.approx(4350.0)
  assert progress.training_seconds(ddp) == pytest.approx(1500.0)


def test_a_digest_a_report_read_that_is_gone_is_named(tmp_path):
  run = grids.grid("smoke")[0]
  report = str(tmp_path / "RESULTS.md")
  analysis.write_index([analysis.Result(run, {}, [], [])], report)
  assert analysis.read_index(report) == [run.name]
  with pytest.raises(FileNotFoundError, match=f"RESULTS.md was written from {run.name}, which "
                     "has no digest in"):
    analysis.load_reported(report, grids.grid("smoke"), str(tmp_path / "digests"))
  assert analysis.load_reported(report, [], str(tmp_path / "digests")) == []


def _checkpoint(workdir, *metas):
  """Checkpoints 1, 2, ... in ``workdir`` with these metas (a tiny state each)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from heloco_jax.rundir import checkpoint  # pylint: disable=g-import-not-at-top
  saved = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
  for step, meta in enumerate(metas, 1):
    saved.save(step, {"w": jnp.ones(3)}, meta)
  saved.close()


def test_runs_with_a_checkpoint_resume_first_and_count_only_the_budget_they_have_left(
    tmp_path, monkeypatch):
  """A run stopped part way (a session's end) holds a share of its budget in its newest
  checkpoint: it goes before the new runs, and the time left and --deadline count only the
  rest of it. Reading the checkpoint writes nothing: its run may be running."""
  out = str(tmp_path)
  runs = [r for r in grids.grid("merge_order") if r.seed == 0][:3]  # 2,560,000 tokens each
  timed_run = next(r for r in grids.grid("body") if r.table == "body/time")  # a time budget
  sim_seconds = dict(timed_run.overrides)["budget.sim_seconds"]
  _checkpoint(os.path.join(out, "runs", runs[2].name),
              {"units": 320_000, "sim_time": 1.0}, {"units": 640_000, "sim_time": 2.0})
  _checkpoint(os.path.join(out, "runs", timed_run.name), {"units": 7, "sim_time": sim_seconds / 2})
  half_written = tmp_path / "runs" / runs[2].name / "checkpoints" / "3.orbax-checkpoint-tmp-9"
  half_written.mkdir()
  todo, started = reproduce.resumes_first([*runs, timed_run], out)
  assert [r.name for r in todo] == [runs[2].name, timed_run.name, runs[0].name, runs[1].name]
  assert started == {runs[2].name: 0.25, timed_run.name: 0.5}  # the newest checkpoint's
  assert half_written.is_dir() and not (tmp_path / "runs" / runs[0].name).exists()
  progress = reproduce.Progress(todo, jobs=1, timed=[(runs[0], 1000.0)], started=started)
  assert progress.training_seconds(runs[2]) == pytest.approx(750.0)
  assert progress.training_seconds(runs[1]) == pytest.approx(1000.0)
  # (750 + 1000 + 1000) s; the body run's size is not timed
  assert progress.eta() == "about 46 min left (+ 1 runs of a size not timed yet)"
  monkeypatch.setattr(reproduce.time, "monotonic", lambda: 0.0)
  deadline = reproduce.START_SECONDS + 800.0  # the resumed run fits, a new one does not
  assert reproduce.next_fitting([runs[1], runs[2]], progress, deadline) == 1


def test_the_runner_resumes_a_stopped_run_before_new_ones(tmp_path, capsys):
  out, digests = str(tmp_path / "out"), str(tmp_path / "digests")
  heloco = next(r for r in grids.grid("smoke") if r.name == "tokens/homogeneous/heloco/seed0")
  tokens = dict(heloco.overrides)["budget.tokens"]
  _checkpoint(os.path.join(out, "runs", heloco.name), {"units": tokens // 4, "sim_time": 1.0})
  assert reproduce.main(["--grid=smoke", f"--out={out}", f"--digests={digests}", "--jobs=1",
                         "--deadline=1e-9", "--only=tokens/homogeneous/(mla|heloco)/",
                         f"--results={tmp_path / 'RESULTS.md'}"]) == 0
  err = capsys.readouterr().err
  assert f"1 resume from their checkpoints first: {heloco.name} at 25%" in err
  assert f"2 runs not started ({heloco.name} next)" in err  # the grid's order puts mla first


@pytest.mark.slow  # 30–80 s: the default suite stays under 15 minutes
def test_parallel_runner_writes_digests_and_skips_them(tmp_path, capsys):
  out, digests = str(tmp_path / "out"), str(tmp_path / "digests")
  args = ["--grid=smoke", f"--out={out}", f"--digests={digests}", "--jobs=2",
          "--only=tokens/homogeneous/(mla|heloco)/"]
  assert reproduce.main(args) == 0
  err = capsys.readouterr().err
  assert "2 at a time, 1 core(s) each" in err and "[2/2 done]" in err
  runs = [r for r in grids.grid("smoke") if re.search(args[-1][7:], r.name)]
  for run in runs:
    with open(analysis.digest_path(digests, run)) as f:
      digest = json.load(f)
    with open(os.path.join(out, "runs", run.name, "summary.json")) as f:
      assert digest["summary"] == json.load(f)
    assert digest["evals"][-1]["val_loss"] == pytest.approx(
        digest["summary"]["final_val_loss"], rel=1e-5)
    assert len(digest["arrivals"]["worker"]) == digest["summary"]["outer_updates"]
    log = os.path.join(out, "logs", run.name + ".log")
    assert "done:" in open(log).read()
  # The report names the runs it was written from (the README's quotes are checked on those).
  assert analysis.read_index(os.path.join(out, "RESULTS.md")) == sorted(r.name for r in runs)
  # The digests alone hold the results: with the runs gone, nothing runs again.
  shutil.rmtree(os.path.join(out, "runs"))
  assert reproduce.main(args) == 0
  assert "2 runs, 2 already finished" in capsys.readouterr().err
  assert len(analysis.load(out, runs, digests)) == 2


@pytest.mark.parametrize("runner", [["--jobs=1"], ["--jobs=1", "--isolate"]])
def test_no_run_starts_after_the_deadline(tmp_path, capsys, runner):
  """--deadline (a leased GPU's calls are cut off, experiments/gpu_scale.sh): past it the
  queue is left for the next command, which still writes its RESULTS.md."""
  out, digests = str(tmp_path / "out"), str(tmp_path / "digests")
  base = ["--grid=smoke", f"--out={out}", f"--digests={digests}", *runner]
  assert reproduce.main([*base, "--deadline=1e-9", "--only=tokens/homogeneous/(mla|heloco)/",
                         f"--results={tmp_path / 'RESULTS.md'}"]) == 0
  err = capsys.readouterr().err
  assert "--deadline passed: 2 runs not started (tokens/homogeneous/mla/seed0 next)" in err
  assert not os.path.exists(os.path.join(out, "runs")) and not os.path.exists(digests)
  assert os.path.exists(tmp_path / "RESULTS.md")
  assert analysis.read_index(str(tmp_path / "RESULTS.md")) == []  # it read no run
  with pytest.raises(SystemExit):
    reproduce.main([*base, "--deadline=-1"])
  assert "--deadline=-1.0 is not allowed" in capsys.readouterr().err


def test_grids_of_one_report_queue_in_order_and_others_are_refused(tmp_path, capsys):
  """--grid=A,B: A's runs, then B's, in one queue, so that under --deadline B's shorter runs
  fill what none of A's fits (next_fitting); grids of different reports, or a name that is
  not a grid, are refused in one line naming them."""
  out, digests = str(tmp_path / "out"), str(tmp_path / "digests")
  assert reproduce.main(["--grid=chaos,streaming", f"--out={out}", f"--digests={digests}",
                         "--jobs=1", "--deadline=1e-9", f"--results={tmp_path / 'R.md'}"]) == 0
  err = capsys.readouterr().err
  first = grids.grid("chaos")[0].name
  total = len(grids.grid("chaos")) + len(grids.grid("streaming"))
  assert f"grid chaos,streaming: {total} runs, 0 already finished" in err
  assert f"--deadline passed: {total} runs not started ({first} next)" in err
  assert (tmp_path / "R.md").exists()
  for value, refusal in (
      ("chaos,huge", "--grid=chaos,huge: 'huge' is not a grid; allowed: ablations, all, "),
      ("body,paper", "--grid=body,paper: grids of one report only, here body (RESULTS.md), "
                     "paper (RESULTS_small_scale.md)")):
    with pytest.raises(SystemExit):
      reproduce.main([f"--grid={value}", f"--out={out}"])
    assert refusal in capsys.readouterr().err


def test_prepare_only_builds_the_corpus_and_runs_nothing(tmp_path, capsys):
  out = str(tmp_path / "out")
  assert reproduce.main(["--grid=smoke", f"--out={out}", "--prepare-only"]) == 0
  assert "these runs read no corpus" in capsys.readouterr().err
  assert not os.path.exists(os.path.join(out, "runs"))


def test_parallel_runner_stops_on_sigterm_with_runs_still_queued(tmp_path):
  """SIGTERM while runs wait in the queue: the running ones stop and the command exits 130
  (it used to wait for the queue forever)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  process = subprocess.Popen(
      [sys.executable, "-m", "experiments.reproduce", "--grid=smoke", f"--out={tmp_path}",
       f"--digests={tmp_path / 'digests'}", "--jobs=2", "--only=tokens/homogeneous/"],
      cwd=root, stderr=subprocess.PIPE, text=True)
  assert process.stderr is not None
  started = 0
  for line in process.stderr:
    started += " started " in line
    if started == 2:  # 3 of the 5 runs are still queued
      break
  process.send_signal(signal.SIGTERM)
  try:
    _, err = process.communicate(timeout=120)
  except subprocess.TimeoutExpired:
    process.kill()
    pytest.fail("the runner did not exit within 120 s of SIGTERM")
  assert process.returncode == 130, err
  assert len(list(tmp_path.glob("runs/tokens/homogeneous/*"))) <= 2  # no queued run started


def test_one_job_runner_goes_on_past_a_failed_run(tmp_path, monkeypatch, capsys):
  from heloco_jax.cli import train  # pylint: disable=g-import-not-at-top
  real = train.main
  monkeypatch.setattr(train, "main", lambda argv: 1 if "tokens/homogeneous/mla/" in argv[0]
                      else real(argv))
  args = ["--grid=smoke", f"--out={tmp_path / 'out'}", f"--digests={tmp_path / 'digests'}",
          "--jobs=1", "--only=tokens/homogeneous/(mla|heloco)/"]
  assert reproduce.main(args) == 1
  err = capsys.readouterr().err
  assert "tokens/homogeneous/mla/seed0 failed (exit 1); the next run starts" in err
  assert "1 runs failed: tokens/homogeneous/mla/seed0" in err
  assert os.listdir(tmp_path / "digests" / "tokens" / "homogeneous") == ["heloco"]


def test_prune_keeps_only_the_newest_checkpoint_of_finished_runs(tmp_path):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from heloco_jax.rundir import checkpoint  # pylint: disable=g-import-not-at-top
  saved = checkpoint.Checkpointer(str(tmp_path / "run" / "checkpoints"))
  for step in (1, 2, 3):
    saved.save(step, {"w": jnp.ones(3) * step}, {"step": step})
  saved.close()
  reproduce.prune_checkpoints(str(tmp_path / "run"))
  assert os.listdir(tmp_path / "run" / "checkpoints") == ["3"]
  reproduce.prune_checkpoints(str(tmp_path / "no_run"))  # nothing there: nothing to do
  # the runner: a run pruned as it finishes
  out = tmp_path / "out"
  assert reproduce.main(["--grid=smoke", f"--out={out}", f"--digests={tmp_path / 'digests'}",
                         "--jobs=1", "--prune", "--only=tokens/homogeneous/heloco/"]) == 0
  assert len(os.listdir(out / "runs" / "tokens" / "homogeneous" / "heloco" / "seed0"
                        / "checkpoints")) == 1


def test_isolate_runs_one_job_in_its_own_process_with_its_log(tmp_path, capsys):
  out = tmp_path / "out"
  args = ["--grid=smoke", f"--out={out}", f"--digests={tmp_path / 'digests'}", "--jobs=1",
          "--isolate", "--only=tokens/homogeneous/mla/"]
  assert reproduce.main(args) == 0
  assert "1 at a time" in capsys.readouterr().err
  assert "done:" in (out / "logs" / "tokens" / "homogeneous" / "mla" / "seed0.log").read_text()
  assert (tmp_path / "digests" / "tokens" / "homogeneous" / "mla" / "seed0.json").exists()


def test_commit_puts_each_digest_into_git_and_nothing_else(tmp_path, capsys):
  repo = tmp_path / "repo"
  git = lambda *args: subprocess.run(["git", "-C", str(repo), *args], check=True,
                                     capture_output=True, text=True).stdout
  repo.mkdir()
  git("init", "-q")
  git("config", "user.email", "test@example.com")
  git("config", "user.name", "test")
  (repo / "notes.md").write_text("work in progress\n")
  git("add", "notes.md")  # staged by the user: the runner's commits leave it staged
  args = ["--grid=smoke", f"--out={tmp_path / 'out'}", f"--digests={repo / 'results'}",
          "--jobs=1", "--only=tokens/homogeneous/(mla|heloco)/", "--commit"]
  assert reproduce.main(args) == 0
  subjects = git("log", "--format=%s").splitlines()
  assert subjects == ["experiments/results: tokens/homogeneous/heloco/seed0",
                      "experiments/results: tokens/homogeneous/mla/seed0"]
  committed = git("ls-tree", "-r", "--name-only", "HEAD").splitlines()
  assert len(committed) == 2 and all(name.startswith("results/") for name in committed)
  assert git("status", "--porcelain").splitlines() == ["A  notes.md"]
  # Without a repository, git's failure is one line and the run still succeeds.
  capsys.readouterr()
  elsewhere = ["--grid=smoke", f"--out={tmp_path / 'out2'}", f"--digests={tmp_path / 'plain'}",
               "--jobs=1", "--only=tokens/homogeneous/mla/", "--commit"]
  assert reproduce.main(elsewhere) == 0
  assert "reproduce: --commit: git failed (" in capsys.readouterr().err
  assert os.listdir(tmp_path / "plain")


def test_the_cgad_grid_runs_every_pace_and_seed_at_its_tuned_lr():
  runs = grids.grid("cgad")
  assert [r.name for r in runs[:5]] == [f"authors/tokens/{p}/cgad/seed0"
                                        for p in grids.AUTHORS_PRESETS]
  assert len(runs) == 15 and {r.method for r in runs} == {"cgad"}
  heloco = {r.name: r for r in grids.grid("authors")}
  for run in runs:
    twin = dict(heloco[run.name.replace("/cgad/", "/heloco/")].overrides)
    assert dict(run.overrides) == {**twin, "method": "cgad",
                                   "outer.learning_rate": grids.cgad_learning_rate()}


def test_the_cgad_lr_check_changes_only_cgads_outer_lr():
  runs = grids.grid("cgad_lr")
  assert [r.name for r in runs] == [f"authors/lr/cgad/x{f:g}" for f in grids.CGAD_LR_FACTORS]
  heloco = dict(next(r for r in grids.grid("authors_lr") if r.method == "heloco").overrides)
  for run, factor in zip(runs, grids.CGAD_LR_FACTORS):
    overrides = dict(run.overrides)
    assert overrides.pop("outer.learning_rate") == pytest.approx(1e-2 * factor)
    assert overrides.pop("method") == "cgad"
    assert overrides == {k: v for k, v in heloco.items()
                         if k not in ("outer.learning_rate", "method")}


def test_symmetric_grid_gives_every_cell_of_the_authors_jitter_and_best_lr_rows_seeds_3_and_4():
  """Issue 60, item 1: seeds 3 and 4 of every claims run of those rows, chosen before the
  runs; the jitter and best-lr runs first (seed by seed, severe first), then the authors
  grid's claims runs (severe first), then CGAD's and DN's at its tuned lr."""
  runs = grids.grid("symmetric")
  names = [r.name for r in runs]
  assert len(set(names)) == len(names) == 2 * (10 + 6) + 2 * 21 + 2 * 10
  assert {r.seed for r in runs} == set(grids.SYMMETRIC_SEEDS) == {3, 4}
  lr_best = lambda seed: [r for r in grids.lr_sweep_grid(seeds=(seed,))]
  first = []
  for seed in (3, 4):
    for preset in ("severe", "moderate"):
      first += [r for r in grids.jitter_grid(seeds=(seed,)) + lr_best(seed) if r.preset == preset]
  assert runs[:32] == first
  assert [r.name for r in runs[:8]] == [
      f"skeptic/jitter/{n}/seed3" for n in ("tokens/severe/async_nesterov",
                                            "tokens/severe/delayed_nesterov", "tokens/severe/mla",
                                            "tokens/severe/heloco", "time/severe/diloco")] + [
          f"skeptic/lr/tokens/severe/{m}/seed3" for m in ("delayed_nesterov/x8", "mla/x0.5",
                                                          "heloco/x0.5")]
  # every run the claims read of those rows: each (preset, method) of the jitter and lr runs
  for grid in ("jitter", "lr_sweep"):
    cells = {(r.table, r.preset, r.method, r.name.split("/")[-2]) for r in grids.grid(grid)
             if r.seed in (1, 2)}
    for seed in (3, 4):
      assert cells <= {(r.table, r.preset, r.method, r.name.split("/")[-2]) for r in runs
                       if r.seed == seed}
  authors = runs[32:74]
  assert all(r.name.startswith("authors/") and r.table in ("tokens", "time") for r in authors)
  assert [r.seed for r in authors] == [3] * 21 + [4] * 21
  assert [r.preset for r in authors[:5]] == ["severe"] * 5
  assert [r.name for r in authors if r.method == "diloco"] == [
      f"authors/time/severe/diloco/seed{s}" for s in (3, 4)]  # the other sync runs: no claim's
  assert {(r.preset, r.method) for r in authors if r.table == "tokens"} == {
      (p, m) for p in grids.AUTHORS_PRESETS for m in grids.METHODS if m != "diloco"}
  assert runs[74:] == (grids.cgad_grid(seeds=(3,)) + grids.dn_tuned_grid(seeds=(3,))
                       + grids.cgad_grid(seeds=(4,)) + grids.dn_tuned_grid(seeds=(4,)))
  # each is the run of that name its own grid would make with seeds 3 and 4
  same = {r.name: r for r in grids.authors_grid(seeds=(3, 4)) + grids.jitter_grid(seeds=(3, 4))
          + grids.lr_sweep_grid(seeds=(3, 4)) + grids.cgad_grid(seeds=(3, 4))
          + grids.dn_tuned_grid(seeds=(3, 4))}
  assert all(same[r.name] == r for r in runs)
  assert grids.SCALES["symmetric"] is grids.AUTHORS


def test_scale_grid_has_10x_the_parameters_a_token_each_and_runs_at_toy_size(tmp_path):
  """Issue 60, item 5: d_model 512, 8 layers, the claims' 2,048-id BPE, ≥ 10× the claims'
  parameters and ≥ 1 token per parameter; severe and mixed paces, HeLoCo, MLA, async Nesterov
  and sync DiLoCo at the authors' lr."""
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from heloco_jax.cli import train  # pylint: disable=g-import-not-at-top
  from heloco_jax.lm import model  # pylint: disable=g-import-not-at-top
  runs = grids.grid("scale")
  assert len(runs) == 3 * 2 * 4 and len({r.name for r in runs}) == len(runs)
  assert [r.name for r in runs[:4]] == [f"scale/tokens/severe/{m}/seed0"
                                         for m in ("async_nesterov", "mla", "heloco")] + [
                                             "scale/time/severe/diloco/seed0"]
  for run in runs:
    keys = dict(run.overrides)
    assert (keys["model.d_model"], keys["model.num_layers"], keys["model.num_heads"]) == (
        512, 8, 8)
    assert keys["data.tokenizer"] == "{corpus}/tokenizer.json"  # the claims' own
    assert keys["jitter"] == grids.JITTER and "outer.learning_rate" not in keys  # authors' lr
    assert keys["model.compute_dtype"] == "bfloat16"
    assert run.preset in ("severe", "mixed") and run.method in grids.SCALE_METHODS
    assert run.table == ("scale/time" if run.method == "diloco" else "scale/tokens")
    if run.method == "diloco":
      assert keys["budget.sim_seconds"] == pytest.approx(
          grids.time_budget(grids.SCALE, run.preset))
    else:
      assert keys["budget.tokens"] == grids.SCALE.tokens == 7_000 * 16 * 256
    assert run.needs_corpus()
  assert reproduce.corpus_vocabularies(runs) == {"tokenizer.json": 2048}
  # the parameters, counted on the model itself (abstractly: nothing is allocated)
  config = model.ModelConfig(vocab_size=2048, d_model=512, num_layers=8, num_heads=8,
                             context=256)
  state = nnx.state(nnx.eval_shape(lambda: model.GPT(config, rngs=nnx.Rngs(params=0))),
                    nnx.Param)
  params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
  assert params == grids.scale_params() == 27_438_080
  assert params >= 10 * grids.scale_params(grids.AUTHORS, grids.AUTHORS_VOCAB) == 10 * 2_126_080
  assert grids.SCALE.tokens >= params  # ≥ 1 token per parameter
  # the scale grid's runs join the one RESULTS.md, just before the body grid's (issue 81)
  family, body = grids.family("scale"), grids.grid("body")
  at = family.index(body[0])
  assert family[at - len(runs):at + len(body)] == runs + body
  assert grids.SCALES["scale"] is grids.SCALE
  # one run of the grid at toy size on the CPU: the same overrides, a shrunk model and data
  toy = dataclasses.replace(grids.SCALE, d_model=16, num_layers=1, num_heads=2, context=16,
                            batch_size=2, tokens=2 * 16 * 5 * 2 * 4, eval_every_tokens=320,
                            inner_total_steps=40, data=grids.SMOKE.data)
  run = next(r for r in grids.scale_grid(toy, seeds=(0,)) if r.method == "heloco")
  assert run.name == "scale/tokens/severe/heloco/seed0"
  workdir = str(tmp_path / "run")
  assert train.main([f"--workdir={workdir}", *run.args()]) == 0
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  assert summary["tokens"] == toy.tokens and np.isfinite(summary["final_val_loss"])
  assert summary["method"] == "heloco"


def _validated(run):
  """``run``'s config through the CLI's validation, on the smoke grid's synthetic data (the
  corpus and its tokenizer are not here)."""
  from heloco_jax.cli.configs import default, validation  # pylint: disable=g-import-not-at-top
  config = default.get_config()
  overrides = {**dict(run.overrides), **dict(grids.SMOKE.data), "data.tokenizer": "bytes"}
  for key, value in overrides.items():
    node = config
    *parents, leaf = key.split(".")
    for parent in parents:
      node = node[parent]
    node[leaf] = value
  validation.validate(config)
  return config


def test_the_faulty_grid_lists_every_rule_a_method_takes_under_every_fault():
  runs = grids.grid("faulty")
  names = [r.name for r in runs]
  # 2 (K, f) × 4 behaviours (clean too) × (diloco 4 + heloco 5 + mla 5 rules) × 3 seeds
  assert len(names) == len(set(names)) == 2 * 4 * 14 * 3 == 336
  assert grids.SCALES["faulty"] is grids.AUTHORS and grids.GRIDS["faulty"] is grids.faulty_grid
  # f = 1 of 6 reaches its 3 seeds (its verdicts) before 2 of 8 starts; seed by seed within.
  assert all(name.startswith("faulty/K6f1/") for name in names[:168])
  assert [r.seed for r in runs[:168]] == sorted(r.seed for r in runs[:168])
  cells = {(r.table, r.method, r.name.split("/")[-2]) for r in runs}
  for k, f in ((6, 1), (8, 2)):
    q = {6: 3, 8: 5}[k]
    for behaviour in ("clean", "sign", "scale10", "noise"):
      table = f"faulty/K{k}f{f}/{behaviour}"
      assert {rule for t, m, rule in cells if t == table and m == "diloco"} == {
          "mean", "trimmed_mean", "median", "centered_clip"}
      for method in ("heloco", "mla"):  # q = 2f + 1: the trimmed mean's run is the median's
        assert {rule for t, m, rule in cells if t == table and m == method} == {
            "mean", "screen", f"mean_q{q}", f"trimmed_mean_q{q}", f"centered_clip_q{q}"}
  assert grids.trimmed_is_median(1, 4) and grids.trimmed_is_median(2, 6)  # ALGORITHMS.md
  assert not grids.trimmed_is_median(1, 5) and not grids.trimmed_is_median(2, 7)
  keys = {r.name: dict(r.overrides) for r in runs}
  run = keys["faulty/K8f2/scale10/heloco/trimmed_mean_q5/seed1"]
  assert (run["num_workers"], run["chaos.faulty"], run["syncer.aggregate"], run["syncer.quorum"],
          run["seed"], run["speeds"], run["jitter"], run["inner.total_steps"]) == (
              8, "0:scale=10,1:scale=10", "trimmed_mean(f=2)", 5, 1, "mild", 0.2, 1250)
  assert keys["faulty/K6f1/clean/mla/screen/seed0"]["chaos.faulty"] == ""
  assert keys["faulty/K6f1/noise/diloco/median/seed2"]["chaos.faulty"] == "0:noise=1"
  assert all(v["budget.tokens"] == grids.AUTHORS.tokens for v in keys.values())
  for run in runs:  # every cell's config is one the CLI takes (one seed: the same keys)
    if run.seed == 0:
      _validated(run)


def test_the_merge_order_grid_compares_both_orders_at_quorum_2_and_3_over_5_seeds():
  runs = grids.grid("merge_order")
  names = [r.name for r in runs]
  assert len(names) == len(set(names)) == 2 * 5 * 2 * 5 == 100
  assert grids.SCALES["merge_order"] is grids.AUTHORS
  assert {r.method for r in runs} == {"heloco"} and {r.seed for r in runs} == set(range(5))
  assert {r.preset for r in runs} == set(grids.AUTHORS_PRESETS)
  pairs = {}
  for r in runs:
    keys = dict(r.overrides)
    pairs.setdefault((keys["syncer.quorum"], r.preset, r.seed), set()).add(
        keys["outer.merge_order"])
    assert keys["jitter"] == 0.2 and keys["budget.tokens"] == grids.AUTHORS.tokens
  assert len(pairs) == 50 and all(v == set(grids.MERGE_ORDERS) for v in pairs.values())
  assert names[0] == "merge_order/q2/homogeneous/merge_then_correct/seed0"
  for run in runs[:20]:  # seed 0: every quorum, preset and order
    config = _validated(run)
    assert config.outer.merge_order == dict(run.overrides)["outer.merge_order"]


def test_the_palsgd8m_grid_tunes_both_on_the_same_seeds_then_runs_the_picks(monkeypatch):
  """Issue 81, item 2: the body model, homogeneous and IID at c = 0.25; seeds 0-2 run every
  DDP factor (its decay over its own 2,000 steps) and every PALSGD candidate (twice the tokens,
  its decay over its own 4,000 local steps); seeds 3 and 4 only the picks, once known."""
  monkeypatch.setattr(grids, "PALSGD8M_DDP_BEST", None)
  monkeypatch.setattr(grids, "PALSGD8M_BEST", None)
  runs = grids.grid("palsgd8m")
  assert len(runs) == 3 * (4 + 3) and {r.seed for r in runs} == {0, 1, 2}
  assert grids.PALSGD8M_DDP_FACTORS == (1.0, math.sqrt(5), 5.0, 10.0)
  assert grids.SCALES["palsgd8m"] is grids.PALSGD8M and grids.scale_params(
      grids.PALSGD8M) == grids.scale_params(grids.BODY) == 7_395_840
  for run in runs:
    keys = dict(run.overrides)
    ddp = keys["method"] == "ddp"
    assert (keys["model.d_model"], keys["model.num_layers"], keys["speeds"],
            keys["data.partition"], keys["comm.latency"], keys["inner.reset_optimizer"]) == (
                256, 8, "homogeneous", "iid", 0.25, False)
    assert keys["budget.tokens"] == (1 if ddp else 2) * 2_560_000
    assert keys["inner.total_steps"] == (2_000 if ddp else 4_000)
    assert keys["budget.eval_every_tokens"] == 64_000
    if ddp:
      factor = float(run.method.split("_x")[1])
      assert keys["inner.learning_rate"] == pytest.approx(2e-4 * factor, rel=3e-3)
    else:
      assert keys["inner.learning_rate"] == 2e-4 and keys["inner.palsgd_coins"] == "shared"
      pull = keys["inner.pseudo_sync_rate"] * 2e-4 / keys["inner.pseudo_sync_prob"]
      assert (keys["outer.learning_rate"], round(pull, 6)) in grids.PALSGD8M_CANDIDATES
  for run in runs[:7]:
    _validated(run)
  monkeypatch.setattr(grids, "PALSGD8M_DDP_BEST", 5.0)
  monkeypatch.setattr(grids, "PALSGD8M_BEST", (0.7, 0.05))
  later = [r.name for r in grids.grid("palsgd8m") if r.seed > 2]
  assert later == [f"palsgd8m/c0.25/{name}/seed{s}" for s in (3, 4)
                   for name in ("ddp_own_decay_x5", "palsgd_lr0.7_pull0.05")]


def _reported(runs):
  """Those of ``runs`` that the committed RESULTS.md was written from, from their digests."""
  experiments_dir = os.path.join(os.path.dirname(__file__), "..", "experiments")
  return analysis.load_reported(os.path.join(experiments_dir, "RESULTS.md"), runs,
                                os.path.join(experiments_dir, "results"))


def test_the_palsgd8m_picks_are_the_rules_on_the_committed_digests():
  """grids.PALSGD8M_DDP_BEST and PALSGD8M_BEST are what science.palsgd8m_picks computes from
  the tuning seeds' digests that RESULTS.md was written from (None while they have not all
  landed there: a digest a grid commits later counts once RESULTS.md is regenerated)."""
  from experiments import science  # pylint: disable=g-import-not-at-top
  results = _reported(grids.palsgd8m_grid(seeds=grids.PALSGD8M.seeds))
  assert science.palsgd8m_picks(results) == (grids.PALSGD8M_DDP_BEST, grids.PALSGD8M_BEST)


def test_each_palsgd8m_ddp_run_reaches_its_own_final_loss_on_its_curve():
  """The target read against curves is the DDP run's last eval row, rounded as every row is
  (``analysis.target_loss``): with the summary's unrounded float32 (3.7108681 below the row's
  3.71087), seed 2's DDP never reached its own final loss and its speedup was nan."""
  from experiments import science  # pylint: disable=g-import-not-at-top
  speedups = science.palsgd8m_speedups(_reported(grids.grid("palsgd8m")))
  assert len(speedups) >= 3 and all(np.isfinite(v) for v in speedups.values()), speedups


@pytest.mark.parametrize("factor", [None, *grids.DDP_FAIR_LR_FACTORS])
def test_every_palsgd_ddp_reaches_its_own_final_loss_at_every_c(factor):
  """Each DDP the PALSGD tables could take as the reference (palsgd_c's, or each palsgd_fair
  factor) reaches its own target on every seed at every c: with the summary's float32 as the
  target, × 2.24's seeds 0 and 2 and × 1's seeds 1 and 2 never did (inf)."""
  from experiments import science  # pylint: disable=g-import-not-at-top
  name = factor and grids.ddp_fair_name(factor)
  times = science.palsgd_times(
      _reported(grids.grid("palsgd_c") + grids.grid("palsgd_fair")), name)
  reference = [t for by_c in times.values() for t in by_c["ddp"].values()]
  assert len(reference) >= 3 and np.all(np.isfinite(reference)), times
