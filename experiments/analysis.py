"""Tables and figures of a grid's runs, for ``experiments/RESULTS.md``.

Reads each run's ``summary.json`` and ``metrics.jsonl`` (DESIGN.md, "Files a
run writes"). Headline numbers follow ALGORITHMS.md: the relative improvement
of final validation loss, (L_baseline − L_heloco) / L_baseline, of the means
over seeds, at a fixed token budget and at a fixed simulated wall-clock budget.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

import numpy as np

from experiments import grids

# The seeds' claims (HeLoCo, Al Asif et al. 2026): the largest improvement reported.
PAPER_CLAIMS = {
    ("tokens", "async"): "up to 7.5% over async DiLoCo baselines",
    ("time", "mla"): "up to 3.3% over MLA",
    ("time", "diloco"): "up to 22.1% over synchronous DiLoCo (severe)",
}


@dataclasses.dataclass
class Result:
  run: grids.Run
  summary: dict[str, Any]
  evals: list[dict[str, Any]]


def load(out_dir: str, runs: Sequence[grids.Run]) -> list[Result]:
  """The finished runs among ``runs`` (those with a summary.json)."""
  results = []
  for run in runs:
    workdir = os.path.join(out_dir, "runs", run.name)
    if not os.path.exists(os.path.join(workdir, "summary.json")):
      continue
    with open(os.path.join(workdir, "summary.json")) as f:
      summary = json.load(f)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      evals = [row for row in map(json.loads, f) if row["event"] == "eval"]
    results.append(Result(run, summary, evals))
  return results


def _losses(results, table, preset, method) -> np.ndarray:
  return np.array([r.summary["final_val_loss"] for r in results
                   if (r.run.table, r.run.preset, r.run.method) == (table, preset, method)])


def _improvement(baseline: float, heloco: float) -> float:
  return 100.0 * (baseline - heloco) / baseline


def loss_table(results: Sequence[Result], table: str) -> str:
  """Markdown: final val loss (mean ± std over seeds) per preset × method, and HeLoCo's gain."""
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


def curves(results: Sequence[Result], fig_dir: str) -> list[str]:
  """PNG figures: val loss vs tokens (token budget) and vs simulated time (time budget)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  os.makedirs(fig_dir, exist_ok=True)
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
    fig.tight_layout()
    path = os.path.join(fig_dir, f"loss_vs_{axis}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
  return paths


def write_results(results: Sequence[Result], path: str, fig_dir: str, command: str,
                  scale_note: str) -> None:
  """Writes the RESULTS.md of ``results`` with its figures under ``fig_dir``."""
  figures = curves(results, fig_dir)
  rel = lambda p: os.path.relpath(p, os.path.dirname(os.path.abspath(path)))
  parts = [
      "# Results", "",
      f"Regenerate with `{command}`.", "", scale_note, "",
      "## Fixed token budget", "",
      f"Paper: HeLoCo {PAPER_CLAIMS[('tokens', 'async')]}.", "",
      loss_table(results, "tokens"), "",
      "## Fixed wall-clock (simulated) budget", "",
      f"Paper: HeLoCo {PAPER_CLAIMS[('time', 'mla')]} and {PAPER_CLAIMS[('time', 'diloco')]}.",
      "", loss_table(results, "time"), "",
      "## Per-language validation loss (fixed token budget, severe)", "",
      language_table(results, "tokens", "severe") or "(no severe runs)", "",
      "## Figures", "",
      *[f"![{os.path.basename(f)}]({rel(f)})" for f in figures], ""]
  with open(path, "w") as f:
    f.write("\n".join(parts))
