"""RESULTS.md's sections of issue 80's grids (experiments/aggregation.py) from made-up digests
written as the runner writes them: the faulty-worker ratios, their intervals and verdicts, the
merge-order rows under the claims table's rule, and one line each while nothing has landed."""

import json
import math
import os
import re

import numpy as np
import pytest
from scipy import stats

from experiments import aggregation, analysis, grids, reproduce, science

# A real digest's summary fields (experiments/results/body/time/mixed/diloco/seed0.json).
_SUMMARY = {"applied_tokens": 2_560_000, "bytes_sent": 0, "initial_val_loss": 7.67,
            "mean_staleness": 0.0, "network_seconds": 0.0, "num_params": 2_126_080,
            "outer_updates": 100, "peak_bytes_per_sync": 0, "rejected": 0, "rejected_tokens": 0,
            "sim_time": 1000.0, "tokens": 2_560_000, "tokens_per_second": 4000.0,
            "wall_seconds": 1800.0}
_LANGUAGES = grids.LANGUAGES.split(",")


def _write(results_dir, name, final, curve=None, rejected_tokens=0, arrivals=None):
  """The digest of the run ``name`` of the faulty or merge_order grid: its summary, an
  evaluation every 5% of the token budget (``curve``: fraction -> loss) and ``arrivals``
  (columns, as a digest keeps them; none by default)."""
  run = next(r for r in grids.grid(name.split("/")[0]) if r.name == name)
  budget = dict(run.overrides)["budget.tokens"]
  curve = curve or (lambda f: final + 2.0 * (1 - f))
  evals = []
  for i in range(21):
    loss = final if i == 20 else curve(i / 20)
    evals.append({"event": "eval", "outer_updates": 5 * i, "sim_time": 50.0 * i,
                  "tokens": budget * i // 20, "val_loss": loss,
                  **{f"val_loss/{x}": loss for x in _LANGUAGES}})
  digest = {"summary": {**_SUMMARY, "final_val_loss": final, "method": run.method,
                        "seed": run.seed, "rejected_tokens": rejected_tokens},
            "evals": evals, "arrivals": arrivals or {}}
  path = analysis.digest_path(str(results_dir), run)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(digest, f)


def _load(results_dir):
  return analysis.load("", grids.grid("faulty") + grids.grid("merge_order"), str(results_dir))


def test_with_no_digests_each_section_is_its_heading_and_one_line():
  assert aggregation.sections([]) == [
      "## Faulty workers: robust aggregation against sign-flipped, scaled and noisy updates",
      "",
      "0 of 336 runs landed: the grid runs in the background (`python -m experiments.reproduce "
      "--grid=faulty --out=DIR --commit`), and this section fills in as its digests land.",
      "",
      "## HeLoCo's merge order under a quorum: merge-then-correct against correct-then-merge",
      "",
      "0 of 100 runs landed: the grid runs in the background (`python -m experiments.reproduce "
      "--grid=merge_order --out=DIR --commit`), and this section fills in as its digests land.",
      ""]
  assert len(grids.grid("faulty")) == 336 and len(grids.grid("merge_order")) == 100


def _interval(ratios):
  """The geometric mean of ``ratios`` and its 95% CI, by hand: Student's t on the logs."""
  x = np.log(np.asarray(ratios))
  half = stats.t.ppf(0.975, x.size - 1) * x.std(ddof=1) / np.sqrt(x.size)
  return np.exp(x.mean()), np.exp(x.mean() - half), np.exp(x.mean() + half)


_CLEAN = {0: 5.0, 1: 5.1, 2: 4.9}  # diloco's clean mean run per seed
# (behaviour, method, rule) -> per-seed ratio to the clean mean (None: NaN), expected verdict
_CELLS = {
    ("sign", "diloco", "mean"): ((2.0, 2.2, 1.9), "**breaks**"),
    ("sign", "diloco", "trimmed_mean"): ((1.02, 1.05, 1.01), "**robust**"),
    ("sign", "diloco", "median"): ((1.1, 1.6, 1.3), "**partly**"),
    ("sign", "diloco", "centered_clip"): ((None,), "**breaks** (diverged on 1 of 1 seeds)"),
    ("clean", "diloco", "trimmed_mean"): ((1.01, 1.03, 1.02), None),
    ("clean", "diloco", "median"): ((1.08, 1.1, 1.12), None),
    ("scale10", "diloco", "median"): ((1.3,), "**partly**"),
}


def _faulty_digests(results_dir):
  for seed, loss in _CLEAN.items():
    _write(results_dir, f"faulty/K6f1/clean/diloco/mean/seed{seed}", loss)
  for (behaviour, method, rule), (ratios, _) in _CELLS.items():
    for seed, ratio in enumerate(ratios):
      loss = math.nan if ratio is None else ratio * _CLEAN[seed]
      _write(results_dir, f"faulty/K6f1/{behaviour}/{method}/{rule}/seed{seed}", loss)
  # heloco's screen on 3 seeds, its clean mean run on 2: read on the 2 paired seeds
  for seed in (0, 1):
    _write(results_dir, f"faulty/K6f1/clean/heloco/mean/seed{seed}", 4.0)
  for seed, loss in enumerate((4.4, 4.8, 9.0)):  # it rejected 1%, 2% and 6% of the tokens
    _write(results_dir, f"faulty/K6f1/sign/heloco/screen/seed{seed}", loss,
           rejected_tokens=(25_600, 51_200, 153_600)[seed])
  # at quorum 3 = 2f + 1 the trimmed mean's run is the median's too
  _write(results_dir, "faulty/K6f1/sign/heloco/trimmed_mean_q3/seed0", 4.2)


def _table(lines, title):
  """The rows of the table under the paragraph ``title``: method|rule -> cells."""
  table = lines[lines.index(title) + 2].splitlines()
  assert table[0].startswith("| method | rule |") and table[1] == "|---|---|---|---|---|---|---|"
  rows = {}
  for line in table[2:]:
    cells = line[2:-2].split(" | ")
    rows[f"{cells[0]}|{cells[1]}"] = cells[2:]
  return rows


def test_faulty_rows_give_each_rules_ratio_to_the_clean_mean_its_interval_and_verdict(tmp_path):
  _faulty_digests(tmp_path)
  results = _load(tmp_path)
  lines = aggregation.faulty_section(results)
  landed = 3 + sum(len(r) for r, _ in _CELLS.values()) + 2 + 3 + 1
  assert len(results) == landed
  assert lines[2].startswith(f"{landed} of 336 runs landed ({landed * 0.5:.1f} core-hours): "
                            "the grid runs in the background")  # 1,800 s a run
  assert ("### K = 6 workers, f = 1 faulty (worker 0); quorum 3 for the peer rules of HeLoCo "
          "and MLA") in lines
  assert not any(line.startswith("### K = 8") for line in lines)  # no runs of it
  sign = _table(lines, "sign (`chaos.faulty=0:sign`):")
  labels = {"mean": "`mean`", "trimmed_mean": "`trimmed_mean(f=1)`", "median": "`median()`",
            "centered_clip": f"`{grids.FAULTY_CENTERED_CLIP}`"}
  for (behaviour, method, rule), (ratios, verdict) in _CELLS.items():
    if behaviour != "sign":
      continue
    loss, ratio, rejected, seeds, found = sign[f"{method}|{labels[rule]}"]
    assert rejected == "0"  # nothing rejected but by the screen
    assert found == verdict
    assert seeds == str(len(ratios))
    if None in ratios:
      assert (loss, ratio) == ("– (diverged on 1)", "diverged")
      continue
    losses = np.array(ratios) * [_CLEAN[s] for s in range(len(ratios))]
    assert loss == f"{losses.mean():.3f} ± {losses.std(ddof=1):.3f}"
    mean, low, high = _interval(ratios)
    assert ratio == f"×{mean:.3f} [{low:.3f}, {high:.3f}]"
    # the verdict from the bounds by hand: robust ≤ 1.25 ≥ breaks at 1.5
    assert verdict == ("**robust**" if high <= 1.25 else "**breaks**" if low >= 1.5
                       else "**partly**")
  # paired by seed: 2 of the screen's 3 seeds have a clean mean run
  loss, ratio, rejected, seeds, verdict = sign["heloco|`screen(norm=2.0)`"]
  assert rejected == "3.0%"  # the mean over its 3 seeds of 1%, 2% and 6% of 2,560,000 tokens
  mean, low, high = _interval([4.4 / 4.0, 4.8 / 4.0])
  screen = np.array([4.4, 4.8, 9.0])  # the loss column reads every seed present
  assert (loss, seeds) == (f"{screen.mean():.3f} ± {screen.std(ddof=1):.3f}", "2 paired of 3")
  assert ratio == f"×{mean:.3f} [{low:.3f}, {high:.3f}]" and verdict == "**partly**"
  # its label says so where the trimmed mean is the median (not in diloco's rounds of 6)
  assert sign["heloco|`trimmed_mean(f=1)` = `median()`, quorum 3"][1:] == [
      "×1.050 (1 seed)", "0", "1", "**robust**"]
  # one seed: no CI, its ratio stands for both bounds
  scale = _table(lines, "scale10 (`chaos.faulty=0:scale=10`):")
  assert scale["diloco|`median()`"][1:] == ["×1.300 (1 seed)", "0", "1", "**partly**"]
  assert "noise (`chaos.faulty=0:noise=1`):" not in lines  # no runs of it
  # what a rule costs when nobody is faulty: its clean run ÷ the clean mean's
  cost = next(line for line in lines if line.startswith("What each rule costs"))
  parts = [f"`{rule}` ×{m:.3f} [{lo:.3f}, {hi:.3f}]" for rule, ratios in (
      ("trimmed_mean(f=1)", _CELLS[("clean", "diloco", "trimmed_mean")][0]),
      ("median()", _CELLS[("clean", "diloco", "median")][0]))
      for m, lo, hi in [_interval(ratios)]]
  assert cost.endswith(f"CI): diloco: {'; '.join(parts)}.")  # heloco has no clean rule but mean


def _three_seeds(bound, side, spread=0.02):
  """Three per-seed ratios whose 95% CI's ``side`` bound ("upper" or "lower") is ``bound``:
  logs m − s, m, m + s (sample std s), bound = exp(m ± t₀.₉₇₅(2)·s/√3)."""
  half = stats.t.ppf(0.975, 2) * spread / np.sqrt(3)
  m = np.log(bound) - half if side == "upper" else np.log(bound) + half
  return tuple(np.exp(m + spread * np.array([-1.0, 0.0, 1.0])))


@pytest.mark.parametrize("ratios,verdict", [
    ((1.25,), "**robust**"), ((1.2506,), "**partly**"), ((1.4994,), "**partly**"),
    ((1.5,), "**breaks**"),  # one seed: its ratio is both bounds
    (_three_seeds(1.249, "upper"), "**robust**"), (_three_seeds(1.251, "upper"), "**partly**"),
    (_three_seeds(1.501, "lower"), "**breaks**"), (_three_seeds(1.499, "lower"), "**partly**"),
    ((1.0, 1.1, 1.2), "**partly**"),  # mean 1.10 but upper bound 1.38
    ((1.6, 1.7, 1.8), "**partly**"),  # mean 1.70 but lower bound 1.47
    ((), "pending (no clean mean run on its seeds yet)"),
    ((1.0, math.inf), "**breaks** (diverged on 1 of 2 seeds)"),
])
def test_verdict_thresholds_are_1_25_on_the_upper_bound_and_1_5_on_the_lower(ratios, verdict):
  assert aggregation.robustness(ratios) == verdict
  if len(ratios) == 3:
    _, low, high = _interval(ratios)
    assert verdict == ("**robust**" if round(high, 3) <= 1.25 else "**breaks**"
                       if round(low, 3) >= 1.5 else "**partly**")


def test_the_interval_is_science_paired_ci_on_the_log_ratios():
  ratios = [1.3, 1.1, 2.4, 1.05]
  assert aggregation.ratio_interval(ratios) == pytest.approx(_interval(ratios))
  assert aggregation.ratio_interval(ratios) == pytest.approx(
      np.exp(science.paired_ci(np.log(ratios))))
  assert aggregation.fault_ratios({0: 2.0, 1: math.nan, 2: 3.0}, {0: 1.0, 1: 1.0}) == [
      2.0, math.inf]  # seed 2 unpaired, seed 1 diverged


# merge-then-correct's gap below correct-then-merge (loss 5.0 flat) per preset and seed
_GAPS = {"mild": (0.05, 0.07, 0.06), "severe": (0.02, -0.03, 0.02)}


def _merge_digests(results_dir, quorum=2):
  for preset, gaps in _GAPS.items():
    for seed, gap in enumerate(gaps):
      _write(results_dir, f"merge_order/q{quorum}/{preset}/correct_then_merge/seed{seed}", 5.0,
             curve=lambda f: 5.0 + (1 - f))
      _write(results_dir, f"merge_order/q{quorum}/{preset}/merge_then_correct/seed{seed}",
             5.0 - gap, curve=lambda f, g=gap: 5.0 + (1 - f) - g)


def test_merge_order_rows_are_judged_and_printed_as_claims_rows(tmp_path):
  _merge_digests(tmp_path)
  results = _load(tmp_path)
  lines = aggregation.merge_order_section(results)
  assert lines[2].startswith("12 of 100 runs landed (6.0 core-hours): the grid runs in the "
                            "background (`python -m experiments.reproduce --grid=merge_order")
  table = [line for block in lines for line in block.splitlines() if line.startswith("|")]
  assert table[:2] == science.claims_header(
      "all 2 cells of the 1 merge-order rows judged",
      "merge-then-correct's gain over correct-then-merge, mean over seeds, per preset")
  assert len(table) == 3  # quorum 3 has no runs: no row
  cells = table[2][2:-2].split(" | ")
  assert len(cells) == table[0].count(" | ") + 1
  assert cells[0].startswith("HeLoCo: merge-then-correct") and cells[0].endswith("quorum 2, "
                                                                                  "token budget")
  assert cells[2:4] == [science.UNDATED, "3 of 5"]
  categories, ps = [], []
  for preset, gaps in _GAPS.items():
    # by hand: per seed, the relative gain at every 5% from 50% to 100% of the budget, averaged
    fractions = np.arange(10, 21) / 20
    per_seed = np.array([np.mean([100 * g / (5.0 + (1 - f)) for f in fractions]) for g in gaps])
    half = stats.t.ppf(0.975, 2) * per_seed.std(ddof=1) / np.sqrt(3)
    low, high = per_seed.mean() - half, per_seed.mean() + half
    categories.append("better" if low > 0 else "worse" if high < 0 else "unclear")
    ps.append(stats.ttest_1samp(per_seed, 0).pvalue)
    assert (f"{preset}: window {per_seed.mean():+.2f}% [{low:+.2f}, {high:+.2f}] "
            f"{categories[-1]}, p ") in cells[-1]
  assert categories == ["better", "unclear"]
  assert cells[4] == "**partly**"  # better at mild only
  holm = [min(1.0, 2 * min(ps)), max(min(1.0, 2 * min(ps)), max(ps))]
  holm = holm if ps[0] <= ps[1] else holm[::-1]
  assert f"Holm p {science._p(holm[0])}" in cells[-1]  # pylint: disable=protected-access
  assert cells[7].startswith("severe: ")  # the severe cell's TOST
  # dated digests after the rule: pre-registered
  dates = {r.origin: science.RULE_TIME + 1.0 for r in results}
  assert f"| {science.PRE_REGISTERED} |" in aggregation.merge_order_table(results, dates)


def test_merge_order_with_runs_of_one_order_only_says_none_are_paired(tmp_path):
  _write(tmp_path, "merge_order/q2/mild/merge_then_correct/seed0", 5.0)
  lines = aggregation.merge_order_section(_load(tmp_path))
  assert len(lines) == 4 and lines[2].startswith("1 of 100 runs landed (0.5 core-hours): ")
  assert lines[2].endswith("as its digests land. No preset has both orders on a seed yet.")


def test_presets_that_run_one_schedule_on_another_clock_are_named_as_one_piece_of_evidence(
    tmp_path):
  """At quorum 3, moderate and severe (one fast and four equally slow workers each) arrived in
  the same order for their first 25-166 arrivals in every pair of runs (2026-12-04)."""
  workers = [0, 2, 1, 3, 4, 0] * 5  # 30 arrivals
  other = {"mild": 3, "moderate": 30, "severe": 30, "mixed": 19}  # arrivals shared with moderate
  for preset, shared in other.items():
    scale = 2.5 if preset == "severe" else 1.0
    for order in ("merge_then_correct", "correct_then_merge"):
      for seed in range(3):
        order_of = workers[:shared] + [(w + 1) % 5 for w in workers[shared:]]
        final = 5.0 + (0.01 * seed if preset == "severe" else 0.0)
        _write(tmp_path, f"merge_order/q3/{preset}/{order}/seed{seed}", final,
               arrivals={"worker": order_of,
                         "sim_time": [scale * 10.0 * (i + 1) for i in range(30)]})
  lines = aggregation.merge_order_section(_load(tmp_path))
  twins = [line for line in lines if line.startswith("At quorum")]
  assert twins == [
      "At quorum 3, moderate and severe run one schedule on clocks 2.50× apart: in each of their "
      "6 pairs of runs (the same order and seed) the workers arrive in the same order for the "
      "first 30–30 arrivals (jitter reorders them later), and the final validation losses are "
      "at most 0.0200 apart, so the two cells are one piece of evidence, not two."]
  assert lines[lines.index(twins[0]) + 1] == ""  # a paragraph of its own
  assert aggregation.TWIN_ARRIVALS == 20  # mixed shares 19 with moderate: not named


def test_report_only_writes_the_sections_and_counts_their_runs_apart(tmp_path):
  digests = tmp_path / "digests"
  _write(digests, "faulty/K6f1/clean/diloco/mean/seed0", 5.0)
  _write(digests, "faulty/K6f1/sign/diloco/mean/seed0", 10.0)
  path = tmp_path / "RESULTS.md"
  assert reproduce.main(["--grid=faulty", f"--out={tmp_path / 'out'}", "--report-only",
                         f"--digests={digests}", f"--results={path}"]) == 0
  text = path.read_text()
  planned = len(set(grids.family("science")) - set(grids.grid("streaming"))
                - set(grids.grid("chaos")) - set(grids.grid("faulty"))
                - set(grids.grid("merge_order")) - set(grids.grid("scale")))
  assert re.search(rf"\b0 of {planned} runs are finished", text)  # the header counts the CPU runs
  assert "| diloco | `mean` | 10.000 | ×2.000 (1 seed) | 0 | 1 | **breaks** |" in text
  assert "0 of 100 runs landed: the grid runs in the background" in text
  assert text.index("## Faulty workers") < text.index("## HeLoCo's merge order") < text.index(
      "## Small scale")
