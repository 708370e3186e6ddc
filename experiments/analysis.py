"""Tables and figures of a grid's runs, for ``experiments/RESULTS.md``.

Reads each run's ``summary.json`` and ``metrics.jsonl`` (DESIGN.md, "Files a
run writes"). Headline numbers follow ALGORITHMS.md: the relative improvement
of final validation loss, (L_baseline − L_heloco) / L_baseline, of the means
over seeds, at a fixed token budget and at a fixed simulated wall-clock budget.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Sequence

import numpy as np

from experiments import grids
from heloco_jax import outer

# The seeds' claims (HeLoCo, Al Asif et al. 2026): the largest improvement reported.
PAPER_CLAIMS = {
    ("tokens", "async"): "up to 7.5% over async DiLoCo baselines",
    ("time", "mla"): "up to 3.3% over MLA",
    ("time", "diloco"): "up to 22.1% over synchronous DiLoCo (severe)",
}


@dataclasses.dataclass
class Result:
  """A finished run. ``source``: the name of the run whose digest this is, when ``run`` is
  another name for it (science.py reads variants' runs as the authors grid's); ``origin``."""
  run: grids.Run
  summary: dict[str, Any]
  evals: list[dict[str, Any]]
  arrivals: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  source: str = ""

  @property
  def origin(self) -> str:
    """The name of the run this result was read from (its digest's path under the results
    folder, without ``.json``)."""
    return self.source or self.run.name


# The arrival fields the tables and figures read; a digest keeps only these.
ARRIVAL_FIELDS = ("worker", "staleness", "sim_time", "outer_updates", "fragment",
                  "cosine_mean", "rotation_mean", "shrinkage_mean",
                  *(f"branch_count/{name}" for name in outer.BRANCH_NAMES))


def _round(value: Any) -> Any:
  """Floats to 6 significant digits (the digests' size), everything else as it is."""
  return float(f"{value:.6g}") if isinstance(value, float) and math.isfinite(value) else value


def digest(workdir: str) -> dict[str, Any]:
  """A finished run's summary, evaluations and arrivals (``ARRIVAL_FIELDS``, as columns):
  what RESULTS.md needs, small enough to commit (experiments/results/)."""
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  arrivals = [r for r in rows if r["event"] == "arrival"]
  fields = [k for k in ARRIVAL_FIELDS if arrivals and k in arrivals[0]]
  return {"summary": summary,
          "evals": [{k: _round(v) for k, v in r.items()} for r in rows if r["event"] == "eval"],
          "arrivals": {k: [_round(a.get(k)) for a in arrivals] for k in fields}}


def digest_path(results_dir: str, run: grids.Run) -> str:
  return os.path.join(results_dir, run.name + ".json")


def write_digest(workdir: str, results_dir: str, run: grids.Run) -> None:
  path = digest_path(results_dir, run)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(digest(workdir), f, separators=(",", ":"), sort_keys=True)
  os.replace(path + ".tmp", path)


def _from_digest(run: grids.Run, data: dict[str, Any]) -> Result:
  columns = data["arrivals"]
  count = len(next(iter(columns.values()), []))
  arrivals = [{k: v[i] for k, v in columns.items()} for i in range(count)]
  return Result(run, data["summary"], data["evals"], arrivals)


def load(out_dir: str, runs: Sequence[grids.Run], results_dir: str = "") -> list[Result]:
  """The finished runs among ``runs``: from their digest in ``results_dir`` when there is one,
  else from ``OUT/runs/<name>`` (those with a summary.json)."""
  results = []
  for run in runs:
    if results_dir and os.path.exists(digest_path(results_dir, run)):
      with open(digest_path(results_dir, run)) as f:
        results.append(_from_digest(run, json.load(f)))
      continue
    workdir = os.path.join(out_dir, "runs", run.name)
    if os.path.exists(os.path.join(workdir, "summary.json")):
      results.append(_from_digest(run, digest(workdir)))
  return results


def index_path(report: str) -> str:
  """Beside a report (``RESULTS.md`` -> ``RESULTS.runs.txt``), the runs it was written from."""
  return os.path.splitext(report)[0] + ".runs.txt"


def write_index(results: Sequence[Result], report: str) -> None:
  """Names the runs ``report`` was written from, so that what quotes it (the README's claims
  rows, ``tests/test_readme.py``) is checked against those runs: digests that a grid commits
  after the report change nothing until the report is regenerated."""
  with open(index_path(report), "w") as f:
    f.write(f"# the runs {os.path.basename(report)} was written from (their digests), one a "
            "line; written with it\n")
    f.writelines(name + "\n" for name in sorted(r.run.name for r in results))


def read_index(report: str) -> list[str]:
  with open(index_path(report)) as f:
    return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def load_reported(report: str, runs: Sequence[grids.Run], results_dir: str) -> list[Result]:
  """The runs among ``runs`` that ``report`` was written from (``write_index``), from their
  digests in ``results_dir``; a digest the report read and that is gone is an error."""
  read = set(read_index(report))
  wanted = [run for run in runs if run.name in read]
  results = load("", wanted, results_dir)
  if len(results) != len(wanted):
    found = {r.run.name for r in results}
    missing = next(run.name for run in wanted if run.name not in found)
    raise FileNotFoundError(f"{report} was written from {missing}, which has no digest in "
                            f"{results_dir}")
  return results


def _losses(results, table, preset, method) -> np.ndarray:
  return np.array([r.summary["final_val_loss"] for r in results
                   if (r.run.table, r.run.preset, r.run.method) == (table, preset, method)])


def _improvement(baseline: float, heloco: float) -> float:
  return 100.0 * (baseline - heloco) / baseline


def compare(results: Sequence[Result], table: str, preset: str,
            baseline: str) -> tuple[float, bool] | None:
  """HeLoCo's improvement (%) over ``baseline``, and whether it exceeds seed noise.

  Beyond noise: the difference of the means is more than twice its standard
  error, sqrt(s_h²/n_h + s_b²/n_b) with sample standard deviations (needs ≥ 2
  seeds each). None when either method has no finished run.
  """
  heloco, base = (_losses(results, table, preset, m) for m in ("heloco", baseline))
  if heloco.size == 0 or base.size == 0:
    return None
  beyond = False
  if heloco.size > 1 and base.size > 1:
    stderr = np.sqrt(heloco.var(ddof=1) / heloco.size + base.var(ddof=1) / base.size)
    beyond = bool(abs(base.mean() - heloco.mean()) > 2 * stderr)
  return _improvement(base.mean(), heloco.mean()), beyond


def _claim_row(claim: str, paper: str, results, table, presets, baselines) -> str:
  """One row of the claims table: the best comparison among presets × baselines."""
  found = [(compare(results, table, p, b), p, b) for p in presets for b in baselines]
  found = [(c, p, b) for c, p, b in found if c is not None]
  if not found:
    return f"| {claim} | {paper} | – | – |"
  (best, beyond), preset, baseline = max(found, key=lambda f: f[0][0])
  wins = sum(c[0] > 0 for c, _, _ in found)
  clear = sum(c[0] > 0 and c[1] for c, _, _ in found)
  losses = sum(c[0] < 0 and c[1] for c, _, _ in found)
  return (f"| {claim} | {paper} | {best:+.2f}% ({preset}, vs {baseline}"
          f"{', beyond seed noise' if beyond else ', within seed noise'}) | HeLoCo lower in "
          f"{wins} of {len(found)}; beyond noise: {clear} better, {losses} worse |")


def claims_table(results: Sequence[Result]) -> str:
  """Markdown: each of the paper's claims next to what these runs measured."""
  lines = ["| claim | paper | best measured here | all comparisons |", "|---|---|---|---|",
           _claim_row("HeLoCo vs async DiLoCo baselines, token budget", "up to +7.5%", results,
                      "tokens", grids.PRESETS, ("async_nesterov", "delayed_nesterov")),
           _claim_row("HeLoCo vs MLA, wall-clock budget", "up to +3.3%", results, "time",
                      grids.PRESETS, ("mla",)),
           _claim_row("HeLoCo vs sync DiLoCo, wall-clock budget, severe", "up to +22.1%",
                      results, "time", ("severe",), ("diloco",))]
  speedups = palsgd_speedups(results)
  if speedups:
    cell = ", ".join(f"{m} {v:+.1f}%" if np.isfinite(v) else f"{m}: DDP's loss not reached"
                     for m, v in speedups.items() if m != "ddp")
    lines.append(f"| PALSGD trains faster than DDP (time to DDP's final loss) | 21.1–24.4% "
                 f"faster | {cell} | – |")
  return "\n".join(lines)


def loss_table(results: Sequence[Result], table: str) -> str:
  """Markdown: final val loss (mean ± std over seeds) per preset × method, and HeLoCo's gain."""
  results = [r for r in results if r.run.table == table]
  if not results:
    return ""
  presets = [p for p in grids.PRESETS if any(r.run.preset == p for r in results)]
  methods = [m for m in grids.METHODS if any(r.run.method == m for r in results)]
  header = ["preset", *methods, *[f"HeLoCo vs {b}" for b in methods if b != "heloco"]]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for preset in presets:
    cells, means = [preset], {}
    for method in methods:
      losses = _losses(results, table, preset, method)
      if losses.size == 0:
        cells.append("–")
        continue
      means[method] = losses.mean()
      cells.append(f"{losses.mean():.4f} ± {losses.std():.4f} (n={losses.size})")
    for baseline in (m for m in methods if m != "heloco"):
      ok = "heloco" in means and baseline in means
      cells.append(f"{_improvement(means[baseline], means['heloco']):+.2f}%" if ok else "–")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def language_table(results: Sequence[Result], table: str, preset: str) -> str:
  """Markdown: the final per-language val loss (mean over seeds) of each method at ``preset``."""
  chosen = [r for r in results if (r.run.table, r.run.preset) == (table, preset)]
  if not chosen:
    return ""
  languages = sorted(k.split("/", 1)[1] for k in chosen[0].evals[-1] if k.startswith("val_loss/"))
  lines = ["| method | " + " | ".join(languages) + " |", "|" + "---|" * (len(languages) + 1)]
  for method in grids.METHODS:
    rows = [r.evals[-1] for r in chosen if r.run.method == method]
    if rows:
      lines.append(f"| {method} | " + " | ".join(
          f"{np.mean([row[f'val_loss/{lang}'] for row in rows]):.4f}" for lang in languages) + " |")
  return "\n".join(lines)


def tune_table(results: Sequence[Result]) -> str:
  """Markdown: final val loss per inner learning rate of the tuning runs (best in bold)."""
  tuned = sorted((dict(r.run.overrides)["inner.learning_rate"], r.summary["final_val_loss"])
                 for r in results if r.run.table == "tune")
  if not tuned:
    return ""
  best = min(tuned, key=lambda t: t[1])[0]
  lines = ["| inner learning rate | final val loss |", "|---|---|"]
  lines += [f"| {'**' if lr == best else ''}{lr:g}{'**' if lr == best else ''} | {loss:.4f} |"
            for lr, loss in tuned]
  return "\n".join(lines)


def time_to_loss(evals: Sequence[dict[str, Any]], target: float) -> float:
  """Simulated time at which val loss first reaches ``target`` (linear between evals); inf if never."""
  for before, after in zip(evals, evals[1:]):
    if after["val_loss"] <= target:
      if before["val_loss"] <= target:
        return before["sim_time"]
      frac = (before["val_loss"] - target) / (before["val_loss"] - after["val_loss"])
      return before["sim_time"] + frac * (after["sim_time"] - before["sim_time"])
  return evals[0]["sim_time"] if evals and evals[0]["val_loss"] <= target else float("inf")


def target_loss(reference: Result) -> float:
  """A reference run's final loss as its curve holds it (its last eval row, rounded as every
  row is): the target that ``time_to_loss`` reads curves against. The summary's unrounded
  float32 can lie below the row (3.7108681 under palsgd8m seed 2's 3.71087), and then the
  reference never reaches its own final loss."""
  return reference.evals[-1]["val_loss"]


def _palsgd_times(results: Sequence[Result]) -> dict[str, list[float]]:
  """Per method, per seed: simulated seconds to reach that seed's DDP final val loss."""
  chosen = [r for r in results if r.run.table == "palsgd"]
  targets = {r.run.seed: target_loss(r) for r in chosen if r.run.method == "ddp"}
  if not targets:
    return {}
  return {m: [time_to_loss(r.evals, targets[r.run.seed]) for r in chosen
              if r.run.method == m and r.run.seed in targets]
          for m in ("ddp", "diloco", "palsgd")}


def _speedups(times: dict[str, list[float]]) -> dict[str, float]:
  if not times:
    return {}
  reference = np.mean(times["ddp"])
  return {m: float(100 * (reference - np.mean(v)) / reference) for m, v in times.items() if v}


def palsgd_speedups(results: Sequence[Result]) -> dict[str, float]:
  """How much sooner (%) than DDP each method reaches DDP's final val loss (mean over seeds);
  −inf for a method that does not reach it in some seed."""
  return _speedups(_palsgd_times(results))


def palsgd_table(results: Sequence[Result]) -> str:
  """Markdown: time for each method to reach DDP's final val loss (per seed), speedup."""
  chosen = [r for r in results if r.run.table == "palsgd"]
  times = _palsgd_times(results)
  if not times:
    return ""
  speedups = _speedups(times)
  lines = ["Target: each seed's DDP final validation loss (DDP reads the token budget; DiLoCo "
           "and PALSGD may read up to twice as many tokens to reach it).", "",
           "| method | tokens | final val loss | simulated s to target | faster than DDP |",
           "|---|---|---|---|---|"]
  for method, values in times.items():
    if not values:
      continue
    runs = [r for r in chosen if r.run.method == method]
    losses = [r.summary["final_val_loss"] for r in runs]
    reached = np.isfinite(values)
    when = (f"{np.mean(values):.0f}" if reached.all()
            else f"not reached in {np.sum(~reached)} of {len(values)} seeds")
    faster = f"{speedups[method]:+.1f}%" if reached.all() else "–"
    lines.append(f"| {method} | {np.mean([r.summary['tokens'] for r in runs]):,.0f} | "
                 f"{np.mean(losses):.4f} ± {np.std(losses):.4f} | {when} | {faster} |")
  return "\n".join(lines)


def ablation_table(results: Sequence[Result]) -> str:
  """Markdown: each ablation variant's final val loss next to the paper grid's run it varies."""
  lines = ["| ablation | variant | method | final val loss | base: paper grid, severe, all seeds "
           "| change |",
           "|---|---|---|---|---|---|"]
  tables = sorted({r.run.table for r in results if r.run.table.startswith("ablation/")})
  for table in tables:
    _, ablation, variant = table.split("/")
    for method in grids.METHODS:
      losses = _losses(results, table, "severe", method)
      base = _losses(results, "tokens", "severe", method)
      if losses.size == 0:
        continue
      base_cell = f"{base.mean():.4f} ± {base.std():.4f}" if base.size else "–"
      change = f"{-_improvement(base.mean(), losses.mean()):+.2f}%" if base.size else "–"
      lines.append(f"| {ablation} | {variant} | {method} | {losses.mean():.4f} ± "
                   f"{losses.std():.4f} (n={losses.size}) | {base_cell} | {change} |")
  return "\n".join(lines) if len(lines) > 2 else ""


def update_share_table(results: Sequence[Result]) -> str:
  """Markdown: per preset and worker, its share of the outer updates, its mean staleness and
  how often HeLoCo corrected its blocks (token table, HeLoCo runs, mean over seeds).

  The arrival schedule depends only on the clock, not on the outer rule, so the
  share and τ are the same for every asynchronous method; what differs is how
  much of each arrival the rule keeps, here the fraction of blocks HeLoCo
  shrank or rotated.
  """
  lines = ["| preset | worker | share of updates | mean τ | blocks shrunk or rotated |",
           "|---|---|---|---|---|"]
  for preset in grids.PRESETS:
    chosen = [r for r in results if (r.run.table, r.run.preset, r.run.method) == (
        "tokens", preset, "heloco") and r.arrivals]
    if not chosen:
      continue
    num_workers = 1 + max(a["worker"] for r in chosen for a in r.arrivals)
    for worker in range(num_workers):
      mine = [[a for a in r.arrivals if a["worker"] == worker] for r in chosen]
      share = np.mean([len(m) / len(r.arrivals) for m, r in zip(mine, chosen)])
      flat = [a for m in mine for a in m]
      tau = np.mean([a["staleness"] for a in flat]) if flat else math.nan
      blocks = sum(sum(a[f"branch_count/{b}"] for b in outer.BRANCH_NAMES) for a in flat)
      corrected = sum(a["branch_count/shrink"] + a["branch_count/rotate"] for a in flat)
      lines.append(f"| {preset} | {worker} | {share:.1%} | {tau:.2f} | "
                   f"{corrected / blocks if blocks else 0:.1%} |")
  return "\n".join(lines) if len(lines) > 2 else ""


def _rolling(values: Sequence[float], window: int = 10) -> np.ndarray:
  values = np.asarray(values, float)
  if values.size < window:
    return values
  return np.convolve(values, np.ones(window) / window, mode="valid")


def _pyplot(fig_dir: str):
  """matplotlib.pyplot on the file-only Agg backend, with ``fig_dir`` created."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  os.makedirs(fig_dir, exist_ok=True)
  return plt


def mean_std(values: Sequence[float], digits: int = 3) -> str:
  """The mean ± sample std of ``values`` (just the mean for one; – for none)."""
  x = np.asarray(values, float)
  if not x.size:
    return "–"
  std = f" ± {np.std(x, ddof=1):.{digits}f}" if x.size > 1 else ""
  return f"{x.mean():.{digits}f}{std}"


def _save(fig, path: str, dpi: int = 110) -> str:
  """Lays out, writes and closes ``fig``; returns ``path``."""
  fig.tight_layout()
  fig.savefig(path, dpi=dpi)
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  plt.close(fig)
  return path


def diagnostics_figures(results: Sequence[Result], fig_dir: str, seed: int = 0,
                        presets: Sequence[str] = grids.PRESETS,
                        branches_preset: str = "severe") -> list[str]:
  """Staleness per worker and preset; alignment over time per method; HeLoCo's branches, λ, β
  (at ``branches_preset``)."""
  all_presets = presets
  plt = _pyplot(fig_dir)
  paths = []
  pick = lambda preset, method: next((r for r in results if (
      r.run.table, r.run.preset, r.run.method, r.run.seed) == ("tokens", preset, method, seed)
      and r.arrivals), None)

  presets = [p for p in all_presets if pick(p, "heloco")]
  if presets:
    fig, axes = plt.subplots(1, len(presets), figsize=(4.2 * len(presets), 3.2), squeeze=False)
    for ax, preset in zip(axes[0], presets):
      arrivals = pick(preset, "heloco").arrivals
      top = max(a["staleness"] for a in arrivals)
      by_worker = [[a["staleness"] for a in arrivals if a["worker"] == w] for w in range(5)]
      ax.hist(by_worker, bins=np.arange(top + 2) - 0.5, stacked=True,
              label=[f"worker {w}" for w in range(5)])
      ax.set_title(f"HeLoCo, {preset}")
      ax.set_xlabel("staleness τ")
      ax.set_ylabel("arrivals")
    axes[0][-1].legend(fontsize=7)
    paths.append(_save(fig, os.path.join(fig_dir, "staleness_per_worker.png")))

  async_methods = [m for m in grids.METHODS if m != "diloco"]
  presets = [p for p in all_presets if any(pick(p, m) for m in async_methods)]
  if presets:
    fig, axes = plt.subplots(1, len(presets), figsize=(4.2 * len(presets), 3.2), squeeze=False)
    for ax, preset in zip(axes[0], presets):
      for color, method in enumerate(grids.METHODS):
        r = pick(preset, method)
        if r is None or method == "diloco" or "cosine_mean" not in r.arrivals[0]:
          continue
        times = [a["sim_time"] for a in r.arrivals]
        cosines = _rolling([a["cosine_mean"] for a in r.arrivals])
        ax.plot(times[len(times) - len(cosines):], cosines, color=f"C{color}", label=method)
      ax.axhline(0, color="k", lw=0.5)
      ax.set_title(f"cos(Δ, m), {preset}")
      ax.set_xlabel("simulated seconds")
    axes[0][-1].legend(fontsize=7)
    paths.append(_save(fig, os.path.join(fig_dir, "alignment_over_time.png")))

  r = pick(branches_preset, "heloco")
  if r is not None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    times = [a["sim_time"] for a in r.arrivals]
    counts = np.array([[a[f"branch_count/{b}"] for b in outer.BRANCH_NAMES] for a in r.arrivals],
                      float)
    fractions = counts / counts.sum(axis=1, keepdims=True)
    left.stackplot(times, fractions.T, labels=list(outer.BRANCH_NAMES))
    left.set_title(f"HeLoCo branches per arrival ({branches_preset})")
    left.set_xlabel("simulated seconds")
    left.set_ylabel("fraction of blocks")
    left.legend(fontsize=7, loc="lower right")
    right.plot(times, [a["rotation_mean"] for a in r.arrivals], label="λ (rotation, mean)")
    right.plot(times, [a["shrinkage_mean"] for a in r.arrivals], label="β (shrinkage, mean)")
    right.set_title(f"HeLoCo λ and β ({branches_preset})")
    right.set_xlabel("simulated seconds")
    right.legend(fontsize=7)
    paths.append(_save(fig, os.path.join(fig_dir, "heloco_branches.png")))
  return paths


def curves(results: Sequence[Result], fig_dir: str) -> list[str]:
  """PNG figures: val loss vs tokens (token budget) and vs simulated time (time budget)."""
  plt = _pyplot(fig_dir)
  paths = []
  for table, axis, label in (("tokens", "tokens", "tokens"),
                             ("time", "sim_time", "simulated seconds")):
    presets = [p for p in grids.PRESETS if any(
        (r.run.table, r.run.preset) == (table, p) for r in results)]
    if not presets:
      continue
    fig, axes = plt.subplots(1, len(presets), figsize=(4.2 * len(presets), 3.4), squeeze=False)
    for ax, preset in zip(axes[0], presets):
      for color, method in enumerate(grids.METHODS):
        for i, r in enumerate(r for r in results
                              if (r.run.table, r.run.preset, r.run.method) == (table, preset,
                                                                                method)):
          ax.plot([e[axis] for e in r.evals], [e["val_loss"] for e in r.evals],
                  color=f"C{color}", alpha=0.8, lw=1.2, label=method if i == 0 else None)
      ax.set_title(preset)
      ax.set_xlabel(label)
      ax.set_ylabel("validation loss")
      ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    paths.append(_save(fig, os.path.join(fig_dir, f"loss_vs_{axis}.png")))
  return paths


def _section(title: str, body: str, intro: str = "", level: int = 2) -> list[str]:
  """A RESULTS.md section's lines (a heading of ``level``); none when ``body`` is empty (no
  runs for it)."""
  if not body:
    return []
  return [f"{'#' * level} {title}", "", *([intro, ""] if intro else []), body, ""]


def write_results(results: Sequence[Result], path: str, fig_dir: str, command: str,
                  scale_note: str) -> None:
  """Writes the RESULTS.md of ``results`` with its figures under ``fig_dir``."""
  figures = curves(results, fig_dir) + diagnostics_figures(results, fig_dir)
  rel = lambda p: os.path.relpath(p, os.path.dirname(os.path.abspath(path)))
  parts = [
      "# Results", "",
      f"Regenerate with `{command}`.", "", scale_note, "",
      *_section("The paper's claims, measured", claims_table(results),
                "Improvement = (L_baseline − L_HeLoCo) / L_baseline of the mean final validation "
                "loss over seeds (ALGORITHMS.md). *Beyond seed noise*: the difference of the "
                "means exceeds twice its standard error."),
      *_section("Inner learning rate (tuned once: sync DiLoCo, homogeneous, seed 100)",
                tune_table(results)),
      *_section("Fixed token budget", loss_table(results, "tokens"),
                f"Paper: HeLoCo {PAPER_CLAIMS[('tokens', 'async')]}."),
      *_section("Fixed wall-clock (simulated) budget", loss_table(results, "time"),
                f"Paper: HeLoCo {PAPER_CLAIMS[('time', 'mla')]} and "
                f"{PAPER_CLAIMS[('time', 'diloco')]}."),
      *_section("PALSGD vs DDP vs DiLoCo (all-reduce = 25% of a DDP step)",
                palsgd_table(results),
                "Paper: PALSGD trains 21.1–24.4% faster than DDP (TinyStories)."),
      *_section("Per-language validation loss (fixed token budget, severe)",
                language_table(results, "tokens", "severe")),
      *_section("Ablations (severe preset, token budget)", ablation_table(results)),
      *_section("Per-worker share of the outer updates (token budget, HeLoCo)",
                update_share_table(results)),
      "## Figures", "",
      *[f"![{os.path.basename(f)}]({rel(f)})" for f in figures], ""]
  with open(path, "w") as f:
    f.write("\n".join(parts))
