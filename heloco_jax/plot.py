"""``heloco-jax plot RUN_DIR [RUN_DIR ...] [--out DIR]``: a run's figures as PNGs.

Reads each run directory's ``config.json`` and ``metrics.jsonl`` (DESIGN.md, "Files a run
writes"); a run still in progress works too (a half-written last line is skipped). Writes:

- ``loss_vs_tokens.png``, ``loss_vs_sim_time.png``: validation loss, the runs overlaid and
  labelled by method and speeds;
- ``staleness_per_worker.png``: per run, a histogram of staleness stacked by worker;
- ``alignment.png``: per run, cos(Δ, m) over simulated time and, for HeLoCo, the fraction of
  blocks in each branch (pass, keep, shrink, rotate);
- ``arrivals_timeline.png``: per run, each worker's arrivals on the simulated clock.

The last three need arrival rows: synchronous methods (ddp, local_sgd, diloco, palsgd) have
none, so their runs appear in the loss figures only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional, Sequence

import numpy as np

from heloco_jax import outer

USAGE = "usage: heloco-jax plot RUN_DIR [RUN_DIR ...] [--out DIR]"


class Run:
  """One run directory's label, evaluations and arrivals."""

  def __init__(self, path: str):
    self.path = path
    config_path, metrics_path = (os.path.join(path, f) for f in ("config.json", "metrics.jsonl"))
    if not os.path.exists(metrics_path):
      raise ValueError(f"{path!r} is not a run directory: it has no metrics.jsonl")
    config: dict[str, Any] = {}
    if os.path.exists(config_path):
      with open(config_path) as f:
        config = json.load(f)
    speeds = config.get("speeds", "")
    speeds = speeds if isinstance(speeds, str) else ",".join(f"{s:g}" for s in speeds)
    self.method = config.get("method", "?")
    self.label = f"{self.method} ({speeds})" if speeds else self.method
    rows = []
    with open(metrics_path) as f:
      for line in f:
        try:
          rows.append(json.loads(line))
        except json.JSONDecodeError:
          break  # a run in progress: its last line may be half written
    self.evals = [r for r in rows if r.get("event") == "eval"]
    self.arrivals = [r for r in rows if r.get("event") == "arrival"]


def _labels(runs: Sequence[Run]) -> list[str]:
  """Each run's label, with its directory name where two labels would be the same."""
  counts = {label: sum(r.label == label for r in runs) for label in {r.label for r in runs}}
  return [r.label if counts[r.label] == 1 else f"{r.label}: {os.path.basename(r.path.rstrip('/'))}"
          for r in runs]


def _grid(plt, n: int, width: float = 4.2, height: float = 3.2):
  fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False)
  return fig, axes[0]


def _save(plt, fig, path: str) -> str:
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def plot(run_dirs: Sequence[str], out: str) -> list[str]:
  """Writes the figures of ``run_dirs`` into ``out``; returns their paths.

  Raises:
    ValueError: a folder that is not a run directory, or no evaluation in any run yet.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  runs = [Run(path) for path in run_dirs]
  if not any(r.evals for r in runs):
    raise ValueError("no run has an evaluation yet (the first is written when training starts)")
  os.makedirs(out, exist_ok=True)
  labels = _labels(runs)
  paths = []
  for axis, xlabel in (("tokens", "tokens"), ("sim_time", "simulated seconds")):
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for run, label in zip(runs, labels):
      evals = [e for e in run.evals if axis in e]
      ax.plot([e[axis] for e in evals], [e["val_loss"] for e in evals], marker=".", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(_save(plt, fig, os.path.join(out, f"loss_vs_{axis}.png")))

  with_arrivals = [(r, label) for r, label in zip(runs, labels) if r.arrivals]
  if not with_arrivals:
    return paths
  num_workers = lambda r: 1 + max(a["worker"] for a in r.arrivals)

  fig, axes = _grid(plt, len(with_arrivals))
  for ax, (run, label) in zip(axes, with_arrivals):
    k = num_workers(run)
    by_worker = [[a["staleness"] for a in run.arrivals if a["worker"] == w] for w in range(k)]
    top = max(a["staleness"] for a in run.arrivals)
    ax.hist(by_worker, bins=np.arange(top + 2) - 0.5, stacked=True,
            label=[f"worker {w}" for w in range(k)])
    ax.set_title(label, fontsize=9)
    ax.set_xlabel("staleness τ")
    ax.set_ylabel("arrivals")
  axes[-1].legend(fontsize=7)
  paths.append(_save(plt, fig, os.path.join(out, "staleness_per_worker.png")))

  fig, axes = _grid(plt, len(with_arrivals), height=3.6)
  for ax, (run, label) in zip(axes, with_arrivals):
    times = [a["sim_time"] for a in run.arrivals]
    if "branch_count/keep" in run.arrivals[0]:
      counts = np.array([[a[f"branch_count/{b}"] for b in outer.BRANCH_NAMES]
                         for a in run.arrivals], float)
      fractions = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
      ax.stackplot(times, fractions.T, labels=[f"{b} (fraction)" for b in outer.BRANCH_NAMES],
                   alpha=0.35)
    if "cosine_mean" in run.arrivals[0]:
      ax.plot(times, [a["cosine_mean"] for a in run.arrivals], color="k", lw=1,
              label="cos(Δ, m)")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_title(label, fontsize=9)
    ax.set_xlabel("simulated seconds")
    ax.legend(fontsize=7, loc="lower right")
  paths.append(_save(plt, fig, os.path.join(out, "alignment.png")))

  fig, axes = _grid(plt, len(with_arrivals), height=0.6 + 0.45 * max(map(num_workers, (
      r for r, _ in with_arrivals))))
  for ax, (run, label) in zip(axes, with_arrivals):
    ax.scatter([a["sim_time"] for a in run.arrivals], [a["worker"] for a in run.arrivals],
               c=[a["staleness"] for a in run.arrivals], cmap="viridis", s=90, marker="|",
               linewidths=2)
    ax.set_yticks(range(num_workers(run)))
    ax.set_title(label, fontsize=9)
    ax.set_xlabel("simulated seconds (colour: staleness)")
    ax.set_ylabel("worker")
  paths.append(_save(plt, fig, os.path.join(out, "arrivals_timeline.png")))
  return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(prog="heloco-jax plot", description=__doc__.splitlines()[0])
  parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories")
  parser.add_argument("--out", default="",
                      help="folder for the PNGs (default: RUN_DIR/plots for one run, ./plots "
                           "for several)")
  args = parser.parse_args(argv)
  out = args.out or (os.path.join(args.run_dirs[0], "plots") if len(args.run_dirs) == 1
                     else "plots")
  try:
    paths = plot(args.run_dirs, out)
  except ValueError as error:
    print(f"heloco-jax plot: {error}", file=sys.stderr)
    return 2
  for path in paths:
    print(path)
  return 0
