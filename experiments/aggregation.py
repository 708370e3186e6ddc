"""RESULTS.md's sections of issue 80's grids (``grids.ISSUE80``), from their digests.

(a) Faulty workers (``grids.faulty_grid``): per (K, f) and behaviour, each method × aggregation
rule's final validation loss against the same method's clean ``mean`` run, paired by seed.
The ratio (``ratio_interval``) is the geometric mean over the paired seeds of loss ÷ the clean
mean's loss, with its paired 95% CI: ``science.paired_ci`` of the log ratios, exponentiated
(ratios multiply, so one seed at 1000× does not stretch the interval a thousandfold). The
verdict (``robustness``): *robust* when the CI's upper bound is ≤ ``ROBUST_RATIO`` (1.25),
*breaks* when its lower bound is ≥ ``BREAKS_RATIO`` (1.5) or a seed diverged (a non-finite
loss), *partly* otherwise; with one seed its ratio stands for both bounds. The bounds are
compared as printed (3 decimals), so that a verdict never contradicts its row. Beside each
(K, f): what each rule costs when nobody is faulty (its clean run ÷ the clean mean's, the same
ratio).

(b) Merge order (``grids.merge_order_grid``): HeLoCo's merge-then-correct against
correct-then-merge as claims rows (``science.Row``: one per quorum, a cell per preset), judged
by the claims table's rule and printed by its functions (``science.claims_header``,
``science.claims_line``): the window gain's paired 95% CI, Holm over the row and over this
table's cells, the severe cells' TOST.

Each section says how many of its grid's runs have landed; with none it is one line.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Optional, Sequence

import numpy as np

from experiments import analysis, grids, science

Result = analysis.Result
ROBUST_RATIO = 1.25
BREAKS_RATIO = 1.5
REFERENCE_RULE = "mean"  # each method's clean run of this rule is the reference
MERGE_THEN_CORRECT, CORRECT_THEN_MERGE = grids.MERGE_ORDERS


def _landed(results: Sequence[Result], grid: str) -> str:
  """One sentence: "n of N runs landed" (and their core-hours), with where the rest come
  from while some are missing."""
  planned = len(grids.grid(grid))
  text = f"{len(results)} of {planned} runs landed"
  if results:
    text += f" ({sum(r.summary.get('wall_seconds', 0.0) for r in results) / 3600:.1f} core-hours)"
  if len(results) < planned:
    text += (f": the grid runs in the background (`python -m experiments.reproduce "
             f"--grid={grid} --out=DIR --commit`), and this section fills in as its digests "
             "land")
  return text + "."


# (a) Faulty workers.


def _by_cell(results: Sequence[Result], value) -> dict[tuple[str, str, str, str], dict[int, float]]:
  """(workers ``K<K>f<f>``, behaviour, method, rule name) -> seed -> ``value(summary)`` of the
  faulty grid's runs (named ``faulty/K<K>f<f>/<behaviour>/<method>/<rule>/seed<s>``)."""
  out: dict[tuple[str, str, str, str], dict[int, float]] = {}
  for r in results:
    _, workers, behaviour, method, rule, _ = r.run.name.split("/")
    out.setdefault((workers, behaviour, method, rule), {})[r.run.seed] = value(r.summary)
  return out


def faulty_losses(results: Sequence[Result]) -> dict[tuple[str, str, str, str], dict[int, float]]:
  """``_by_cell``: each run's final validation loss."""
  return _by_cell(results, lambda summary: float(summary["final_val_loss"]))


def faulty_rejected(results: Sequence[Result]) -> dict[tuple[str, str, str, str], dict[int, float]]:
  """``_by_cell``: the share of the run's tokens whose pseudo-gradients were rejected (a
  screen's, or non-finite): the work a rule threw away."""
  return _by_cell(results, lambda summary: (
      summary.get("rejected_tokens", 0) / max(1, summary.get("tokens", 0))))


def fault_ratios(losses: dict[int, float], clean: dict[int, float]) -> list[float]:
  """Per seed both have (and ``clean`` is finite), ``losses`` ÷ ``clean``; inf where the
  run's loss is not finite (it diverged)."""
  return [losses[s] / clean[s] if math.isfinite(losses[s]) else math.inf
          for s in sorted(losses) if s in clean and math.isfinite(clean[s])]


def ratio_interval(ratios: Sequence[float]) -> tuple[float, float, float]:
  """(geometric mean, low, high) of ``ratios`` (one per seed, finite and > 0): the paired 95%
  CI of ``science.paired_ci`` on their logs, exponentiated; low and high NaN for one seed."""
  return tuple(float(np.exp(x)) for x in science.paired_ci(np.log(ratios)))  # type: ignore


def robustness(ratios: Sequence[float]) -> str:
  """The verdict of a row's ``fault_ratios`` (module docstring): robust, breaks or partly."""
  if not ratios:
    return "pending (no clean mean run on its seeds yet)"
  diverged = sum(not math.isfinite(x) for x in ratios)
  if diverged:
    return f"**breaks** (diverged on {diverged} of {len(ratios)} seeds)"
  mean, low, high = (round(x, 3) for x in ratio_interval(ratios))  # as printed
  if len(ratios) < 2:
    low = high = mean
  if high <= ROBUST_RATIO:
    return "**robust**"
  if low >= BREAKS_RATIO:
    return "**breaks**"
  return "**partly**"


def _times(x: float) -> str:
  return f"×{x:.3f}" if x < 1000 else f"×{x:.3g}"


def ratio_text(ratios: Sequence[float]) -> str:
  """``ratio_interval`` as the table prints it: ×mean [low, high]."""
  if not ratios:
    return "–"
  if not all(map(math.isfinite, ratios)):
    return "diverged"
  mean, low, high = ratio_interval(ratios)
  return _times(mean) + (f" [{low:.3f}, {high:.3f}]" if math.isfinite(low) else " (1 seed)")


def _loss_text(losses: Sequence[float]) -> str:
  finite = [x for x in losses if math.isfinite(x)]
  text = analysis.mean_std(finite) if finite else "–"
  return text + (f" (diverged on {len(losses) - len(finite)})" if len(finite) < len(losses)
                 else "")


def _rule_label(method: str, num_workers: int, f: int, rule: str) -> str:
  """A rule's ``syncer.aggregate`` (and its quorum when > 1), from ``grids.faulty_rules``; a
  trimmed mean that is the median there says so."""
  spec, quorum = next((s, q) for name, s, q in grids.faulty_rules(method, num_workers, f)
                      if name == rule)
  same = (" = `median()`" if quorum > 1 and rule.startswith("trimmed_mean")
          and grids.trimmed_is_median(f, quorum) else "")
  return f"`{spec}`{same}" + (f", quorum {quorum}" if quorum > 1 else "")


def _rows(losses, workers: str, behaviour: str, num_workers: int, f: int):
  """(method, rule name, losses by seed, ratios to the clean mean) of one table, in the
  grid's order, for the rules with runs."""
  for method in grids.FAULTY_METHODS:
    clean = losses.get((workers, "clean", method, REFERENCE_RULE), {})
    for rule, _, _ in grids.faulty_rules(method, num_workers, f):
      cell = losses.get((workers, behaviour, method, rule))
      if cell:
        yield method, rule, cell, fault_ratios(cell, clean)


def _share_text(shares: Sequence[float]) -> str:
  """The mean share of tokens rejected over a cell's seeds, as a percentage ("0" for none)."""
  mean = float(np.mean(shares)) if shares else 0.0
  return "0" if mean == 0 else f"{100 * mean:.1f}%"


def faulty_table(losses, workers: str, behaviour: str, num_workers: int, f: int,
                 rejected: Optional[dict] = None) -> str:
  """Markdown: one (K, f) and behaviour: per method × rule, the final loss, its ratio to the
  clean mean (paired), the share of tokens rejected (``faulty_rejected``: mean over the
  seeds), the paired seeds and the verdict; "" without runs."""
  lines = ["| method | rule | final val loss | ÷ the method's clean mean run (paired, 95% CI) "
           "| tokens rejected | seeds | verdict |", "|---|---|---|---|---|---|---|"]
  for method, rule, cell, ratios in _rows(losses, workers, behaviour, num_workers, f):
    seeds = f"{len(ratios)}" + (f" paired of {len(cell)}" if len(ratios) < len(cell) else "")
    shares = list((rejected or {}).get((workers, behaviour, method, rule), {}).values())
    lines.append(f"| {method} | {_rule_label(method, num_workers, f, rule)} | "
                 f"{_loss_text(list(cell.values()))} | {ratio_text(ratios)} | "
                 f"{_share_text(shares)} | {seeds} | {robustness(ratios)} |")
  return "\n".join(lines) if len(lines) > 2 else ""


def clean_cost(losses, workers: str, num_workers: int, f: int) -> str:
  """One sentence: what each rule but the reference costs when nobody is faulty; ""
  without clean runs to pair."""
  costs: dict[str, list[str]] = {}
  for method, rule, _, ratios in _rows(losses, workers, "clean", num_workers, f):
    if rule != REFERENCE_RULE and ratios:
      costs.setdefault(method, []).append(
          f"{_rule_label(method, num_workers, f, rule)} {ratio_text(ratios)}")
  if not costs:
    return ""
  return ("What each rule costs when nobody is faulty (its clean run's final loss ÷ the "
          "clean mean's, paired by seed, 95% CI): "
          + ". ".join(f"{method}: " + "; ".join(texts) for method, texts in costs.items()) + ".")


def _workers_text(f: int) -> str:
  return "worker 0" if f == 1 else f"workers {', '.join(map(str, range(f - 1)))} and {f - 1}"


def faulty_section(results: Sequence[Result]) -> list[str]:
  """RESULTS.md's faulty-worker section (markdown lines)."""
  head = ["## Faulty workers: robust aggregation against sign-flipped, scaled and noisy "
          "updates", ""]
  if not results:
    return head + [_landed(results, "faulty"), ""]
  losses, rejected = faulty_losses(results), faulty_rejected(results)
  faulty = {r.run.table: dict(r.run.overrides)["chaos.faulty"] for r in results}
  setups = " and ".join(f"K = {k} workers with f = {f} faulty" for k, f in grids.FAULTY_WORKERS)
  lines = head + [
      f"{_landed(results, 'faulty')} Issue 80's grid (`--grid=faulty`): the authors' harness "
      f"(the claims' model and corpus, {grids.AUTHORS.tokens:,} tokens per run) with {setups}, "
      f"at {grids.FAULTY_PRESET} paces, jitter {grids.JITTER:g}, the inner decay over each "
      "worker's 10,000 / K steps; the faulty workers' behaviours (`chaos.faulty`, "
      "docs/ALGORITHMS.md): sign flip −Δ, ×10, Gaussian noise of σ = 1 × the leaf's rms; "
      f"{len(grids.AUTHORS.seeds)} seeds. DiLoCo takes the peer rules in its rounds; HeLoCo "
      "and MLA take the mean and the norm screen on single arrivals and the peer rules in "
      "quorum groups, with the mean at that quorum too; at their quorum q = 2f + 1 the trimmed "
      "mean of f keeps the middle value, the median's, bit for bit: one run serves both.", "",
      "A row's tokens rejected: the share of its run's tokens whose pseudo-gradients the rule "
      "rejected (the screen's; mean over its seeds). How a row is judged: its final loss "
      "(mean ± sample "
      "std over its seeds) is divided, seed by seed, by the same method's clean `mean` run's: "
      "the ratio is the geometric mean of those per-seed ratios with its paired 95% CI "
      "(Student's t on the log ratios). Verdict: **robust** when the CI's upper bound is ≤ "
      f"{ROBUST_RATIO:g}, **breaks** when its lower bound is ≥ {BREAKS_RATIO:g} or a seed "
      "diverged (a non-finite loss), **partly** otherwise; with one seed the ratio stands for "
      "both bounds (bounds as printed, 3 decimals).", ""]
  for num_workers, f in grids.FAULTY_WORKERS:
    workers = f"K{num_workers}f{f}"
    tables = [(b, faulty_table(losses, workers, b, num_workers, f, rejected))
              for b, _ in grids.FAULTY_BEHAVIOURS if b != "clean"]
    cost = clean_cost(losses, workers, num_workers, f)
    if not cost and not any(t for _, t in tables):
      continue
    lines += [f"### K = {num_workers} workers, f = {f} faulty ({_workers_text(f)}); quorum "
              f"{grids.FAULTY_QUORUM[num_workers]} for the peer rules of HeLoCo and MLA", ""]
    if cost:
      lines += [cost, ""]
    for behaviour, table in tables:
      if table:
        spec = faulty[f"faulty/{workers}/{behaviour}"]
        lines += [f"{behaviour} (`chaos.faulty={spec}`):", "", table, ""]
  return lines


# (b) Merge order.


def merge_order_rows(results: Sequence[Result]) -> list[science.Row]:
  """A claims row per ``grids.MERGE_QUORUMS``: merge-then-correct's runs as HeLoCo's and
  correct-then-merge's as the baseline's (method ``CORRECT_THEN_MERGE``), token table, a cell
  per preset of ``grids.AUTHORS_PRESETS``, seeds ``grids.MERGE_SEEDS``."""
  rows = []
  for quorum in grids.MERGE_QUORUMS:
    runs = []
    for r in results:
      _, q, _, order, _ = r.run.name.split("/")
      if q == f"q{quorum}":
        method = "heloco" if order == MERGE_THEN_CORRECT else CORRECT_THEN_MERGE
        runs.append(dataclasses.replace(r, run=dataclasses.replace(
            r.run, table="tokens", method=method), source=r.origin))
    rows.append(science.Row(
        f"HeLoCo: merge-then-correct (the authors' Decoupled HeLoCo, the default) beats "
        f"correct-then-merge, quorum {quorum}, token budget", "– (not measured before)", runs,
        "tokens", grids.AUTHORS_PRESETS, (CORRECT_THEN_MERGE,), grids.MERGE_SEEDS,
        label=lambda preset, baseline: preset))
  return rows


def merge_order_table(results: Sequence[Result],
                      dates: Optional[dict[str, float]] = None) -> str:
  """Markdown: ``merge_order_rows`` judged and printed as the claims table's rows, the
  whole-family Holm correction over this table's cells; "" without paired runs."""
  rows: list[tuple[science.Row, list[dict[str, Any]]]] = [
      (row, row.cells()[0]) for row in merge_order_rows(results)]
  rows = [(row, cells) for row, cells in rows if cells]
  if not rows:
    return ""
  judged = science.judge_family([cells for _, cells in rows])
  size, judged_rows = science.family_size([cells for _, cells in rows])
  lines = science.claims_header(
      f"all {size} cells of the {judged_rows} merge-order rows judged",
      "merge-then-correct's gain over correct-then-merge, mean over seeds, per preset")
  lines += [science.claims_line(row, cells, dates) for (row, _), cells in zip(rows, judged)]
  return "\n".join(lines)


TWIN_ARRIVALS = 20  # presets whose paired runs share at least this many first arrivals


def _shared_arrivals(a: Result, b: Result) -> int:
  """How many first arrivals two runs share: the same worker at each."""
  pairs = zip((x["worker"] for x in a.arrivals), (y["worker"] for y in b.arrivals))
  return next((i for i, (x, y) in enumerate(pairs) if x != y),
              min(len(a.arrivals), len(b.arrivals)))


def schedule_twins(results: Sequence[Result]) -> list[str]:
  """A sentence per pair of presets that, at one quorum, run one schedule on another clock:
  in every pair of their runs of the same order and seed, the workers arrive in the same order
  for the first ``TWIN_ARRIVALS`` arrivals or more. Their cells are one piece of evidence."""
  by_key = {}
  for r in results:
    _, quorum, preset, order, seed = r.run.name.split("/")
    by_key[quorum, preset, order, seed] = r
  sentences = []
  for quorum in sorted({key[0] for key in by_key}):
    for a, b in itertools.combinations(grids.AUTHORS_PRESETS, 2):
      pairs = [(r, by_key[quorum, b, order, seed]) for (q, preset, order, seed), r
               in sorted(by_key.items()) if (q, preset) == (quorum, a)
               and (quorum, b, order, seed) in by_key]
      shared = [_shared_arrivals(x, y) for x, y in pairs]
      if not pairs or min(shared) < TWIN_ARRIVALS:
        continue
      gap = max(abs(x.summary["final_val_loss"] - y.summary["final_val_loss"]) for x, y in pairs)
      clock = np.median([y.arrivals[-1]["sim_time"] / x.arrivals[-1]["sim_time"]
                         for x, y in pairs])
      sentences.append(
          f"At quorum {quorum[1:]}, {a} and {b} run one schedule on clocks {clock:.2f}× apart: "
          f"in each of their {len(pairs)} pairs of runs (the same order and seed) the workers "
          f"arrive in the same order for the first {min(shared)}–{max(shared)} arrivals "
          f"(jitter reorders them later), and the final validation losses are at most "
          f"{gap:.4f} apart, so the two cells are one piece of evidence, not two.")
  return sentences


def merge_order_section(results: Sequence[Result],
                        dates: Optional[dict[str, float]] = None) -> list[str]:
  """RESULTS.md's merge-order section (markdown lines)."""
  head = ["## HeLoCo's merge order under a quorum: merge-then-correct against "
          "correct-then-merge", ""]
  table = merge_order_table(results, dates)
  if not table:
    return head + [_landed(results, "merge_order")
                   + (" No preset has both orders on a seed yet." if results else ""), ""]
  return head + [
      f"{_landed(results, 'merge_order')} Issue 80's grid (`--grid=merge_order`): HeLoCo in "
      f"the authors' harness with `syncer.quorum` {' and '.join(map(str, grids.MERGE_QUORUMS))} "
      f"at the authors' paces, jitter {grids.JITTER:g}, the token budget, seeds "
      f"{', '.join(map(str, grids.MERGE_SEEDS))}; `outer.merge_order` "
      f"{MERGE_THEN_CORRECT} (the default, the authors' Decoupled HeLoCo: a quorum's "
      f"pseudo-gradients merged, token-weighted, then corrected once) against "
      f"{CORRECT_THEN_MERGE} (each arrival corrected, then merged). Judged by the claims "
      "table's rule (\"The claims, measured\"): per preset, merge-then-correct's relative gain "
      "over correct-then-merge, paired by seed, averaged over 50–100% of the budget, with its "
      "paired 95% CI; Holm over each row's cells and over this table's; the severe cell's "
      f"TOST ±{science.TIE_MARGIN:g}%. *reproduced*: merge-then-correct is better at every "
      "preset; *reversed*: correct-then-merge is better at some preset and merge-then-correct "
      "at none; *not reproduced*: no preset shows a difference.", "", table, "",
      *(line for sentence in schedule_twins(results) for line in (sentence, ""))]


def sections(results: Sequence[Result], dates: Optional[dict[str, float]] = None
             ) -> list[str]:
  """RESULTS.md's sections of issue 80's grids from their ``results`` (``dates``:
  ``science.digest_dates``, for the merge-order rows' rule column); one line each while
  nothing has landed."""
  faulty, merged = set(grids.grid("faulty")), set(grids.grid("merge_order"))
  return (faulty_section([r for r in results if r.run in faulty])
          + merge_order_section([r for r in results if r.run in merged], dates))
