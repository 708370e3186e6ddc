"""``heloco-jax plot RUN_DIR [RUN_DIR ...] [--out DIR]``: a run's figures as PNGs.

Reads each run directory's ``config.json`` and ``metrics.jsonl`` (DESIGN.md, "Files a run
writes"); a run still in progress works too (a half-written last line is skipped). Writes:

- ``loss_vs_tokens.png`` (``loss_vs_steps.png`` for runs that count steps, as
  ``hj.simulate`` does without ``tokens_per_step``), ``loss_vs_sim_time.png``: validation
  loss, the runs overlaid and labelled by method and speeds;
- ``<key>_vs_tokens.png`` (or ``_vs_steps``) for every other number the eval rows hold (an
  ``eval_fn``'s accuracy; ``a/b`` as ``a_b``, and a key a file name cannot hold, or two that
  would meet, cut to 80 safe characters and a hash of the key);
- ``staleness_per_worker.png``: per run, a histogram of staleness stacked by worker;
- ``alignment.png``: per run, cos(Δ, m) over simulated time and, for HeLoCo, the fraction of
  blocks in each branch (pass, keep, shrink, rotate);
- ``arrivals_timeline.png``: per run, each worker's arrivals on the simulated clock.

The last three need arrival rows: synchronous methods (ddp, local_sgd, diloco, palsgd) have
none, so their runs appear in the loss figures only.
An arrival row whose ``sim_time`` is not finite is left out, with a one-line warning.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import sys
import warnings
from typing import Any, Optional, Sequence

import numpy as np

from heloco_jax import outer
from heloco_jax.rundir import safe_files

USAGE = "usage: heloco-jax plot RUN_DIR [RUN_DIR ...] [--out DIR]"


class Run:
  """One run directory's label, evaluations and arrivals.

  Raises:
    ValueError: the folder is not a run directory, or a row is malformed (naming the file,
      the line and what is wrong; only a half-written last line is skipped).
  """

  def __init__(self, path: str):
    self.path = path
    config_path, metrics_path = (os.path.join(path, f) for f in ("config.json", "metrics.jsonl"))
    if not os.path.isfile(metrics_path):
      raise ValueError(f"{path!r} is not a run directory: it has no metrics.jsonl")
    config: Any = {}
    if os.path.exists(config_path):
      try:
        with open(config_path) as f:
          config = json.load(f)
      except ValueError as error:
        raise ValueError(f"{config_path} is not valid JSON ({error})") from None
    if not isinstance(config, dict):
      raise ValueError(f"{config_path} holds a {type(config).__name__}; allowed: a JSON object")
    speeds = config.get("speeds", "")
    if isinstance(speeds, (list, tuple)):
      speeds = ",".join(f"{s:g}" if isinstance(s, (int, float)) else str(s) for s in speeds)
    self.method = str(config.get("method", "?"))
    self.label = f"{self.method} ({speeds})" if speeds != "" else self.method
    with open(metrics_path) as f:
      lines = f.read().split("\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    rows = []
    for number, line in enumerate(lines, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except ValueError:
        if number - 1 == last:
          break  # a run in progress: its last line may be half written
        raise ValueError(f"{metrics_path}:{number}: not valid JSON; allowed: one JSON object "
                         "per line (only a half-written last line is skipped)") from None
      rows.append(_checked(row, metrics_path, number))
    self.evals = [r for r in rows if r.get("event") == "eval"]
    arrivals = [r for r in rows if r.get("event") == "arrival"]
    self.arrivals = [r for r in arrivals if math.isfinite(r["sim_time"])]
    if len(self.arrivals) < len(arrivals):  # matplotlib would leave them out without a word
      dropped = len(arrivals) - len(self.arrivals)
      warnings.warn(f"{metrics_path}: {dropped} arrival row{'s' if dropped > 1 else ''} with a "
                    "sim_time that is not finite (Infinity or NaN) "
                    f"{'are' if dropped > 1 else 'is'} left out of the figures", stacklevel=2)


def _number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _checked(row: Any, path: str, number: int) -> dict[str, Any]:
  """``row`` if it has what the figures read, else a ValueError naming the line."""
  where = f"{path}:{number}"
  if not isinstance(row, dict):
    raise ValueError(f"{where}: a {type(row).__name__}; allowed: a JSON object (a row)")
  event = row.get("event")
  if event == "eval" and not (_number(row.get("val_loss")) or row.get("val_loss") is None):
    raise ValueError(f"{where}: an eval row's val_loss is {row.get('val_loss')!r}; allowed: "
                     "a number")
  if event == "eval" and "val_loss" not in row:
    raise ValueError(f"{where}: an eval row without val_loss")
  if event == "eval":  # where it is drawn: its tokens (or steps) and simulated seconds
    units = [key for key in UNITS if key in row]
    if not units or "sim_time" not in row:
      raise ValueError(f"{where}: an eval row without {'tokens or steps' if not units else 'sim_time'}"
                       "; allowed: rows as heloco-jax writes them (docs/DESIGN.md, "
                       "'metrics.jsonl')")
    for key, value in row.items():
      if key in (*units, "sim_time") or (_number(value) and key != "outer_updates"):
        if not (_number(value) and math.isfinite(value)):
          raise ValueError(f"{where}: an eval row's {key} is {value!r}; allowed: a finite "
                           "number (a non-finite loss is written as null)")
  if event == "arrival":
    for key, bound in (("worker", MAX_WORKER), ("staleness", MAX_STALENESS)):
      value = row.get(key)
      if not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= bound):
        raise ValueError(f"{where}: an arrival row's {key} is {value!r}; allowed: an integer "
                         f"in [0, {bound}]")
    if not _number(row.get("sim_time")):
      raise ValueError(f"{where}: an arrival row's sim_time is {row.get('sim_time')!r}; "
                       "allowed: a number")
  return row


# Bounds of the arrival rows' integers that the figures lay out (a worker per row of the
# timeline, a histogram bin per staleness up to 100).
MAX_WORKER, MAX_STALENESS = 4095, 10**9


UNITS = ("tokens", "steps")
# Eval-row keys that are not a metric of their own figure.
_NOT_METRICS = {"event", "sim_time", "outer_updates", "val_loss", *UNITS}


def _extra_eval_keys(runs: Sequence[Run]) -> list[str]:
  """The numeric keys of the eval rows besides val_loss and its per-language parts (e.g. an
  ``eval_fn``'s accuracy), in the order they first appear."""
  keys: dict[str, None] = {}
  for run in runs:
    for row in run.evals:
      for key, value in row.items():
        if key not in _NOT_METRICS and not key.startswith("val_loss/") and _number(value):
          keys.setdefault(key)
  return list(keys)


def _printable(key: str, limit: int = 60) -> str:
  """``key`` as an axis label: control characters as escapes, cut at ``limit``."""
  text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in key)
  return text if len(text) <= limit else text[:limit - 1] + "…"


def _labels(runs: Sequence[Run]) -> list[str]:
  """Each run's label, with its directory name where two labels would be the same."""
  counts = {label: sum(r.label == label for r in runs) for label in {r.label for r in runs}}
  return [r.label if counts[r.label] == 1 else f"{r.label}: {os.path.basename(r.path.rstrip('/'))}"
          for r in runs]


def _grid(plt, n: int, width: float = 4.2, height: float = 3.2):
  fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False)
  return fig, axes[0]


def _file_names(keys: Sequence[str]) -> dict[str, str]:
  """Each eval key's figure name: its characters a file name allows ('a/b' -> 'a_b'), at most
  80, and a hash of the key where that changed it beyond '/' or two keys would meet (a key
  300 characters long, or holding a NUL, names no file)."""
  names, taken = {}, {"loss"}
  for key in keys:
    name = re.sub(r"[^\w.\-]", "_", key.replace("/", "_"), flags=re.ASCII)
    if name != key.replace("/", "_") or len(name) > 80 or name in taken or name.startswith("."):
      name = f"{name[:80]}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
    names[key] = name
    taken.add(name)
  return names


def _save(plt, fig, path: str) -> str:
  fig.tight_layout()
  safe_files.save_figure(fig, path, dpi=100)  # never through a link at ``path``
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
  safe_files.make_dirs(out)
  labels = _labels(runs)
  paths = []
  # Runs count tokens (the CLI) or steps (hj.simulate without tokens_per_step): a figure
  # against each unit some run counts, and against simulated seconds.
  axes_ = [(unit, unit) for unit in UNITS if any(unit in e for r in runs for e in r.evals)]
  axes_.append(("sim_time", "simulated seconds"))
  extra = _extra_eval_keys(runs)
  names = {"val_loss": "loss", **_file_names(extra)}
  for key in ["val_loss", *extra]:
    for axis, xlabel in axes_:
      if key != "val_loss" and axis == "sim_time":
        continue
      fig, ax = plt.subplots(figsize=(6.5, 4))
      for run, label in zip(runs, labels):
        evals = [e for e in run.evals if axis in e and key in e]
        if evals:
          ax.plot([e[axis] for e in evals], [np.nan if e[key] is None else e[key]
                                             for e in evals], marker=".", label=label)
      ax.set_xlabel(xlabel)
      ax.set_ylabel("validation loss" if key == "val_loss" else _printable(key))
      ax.grid(alpha=0.3)
      ax.legend(fontsize=8)
      paths.append(_save(plt, fig, os.path.join(out, f"{names[key]}_vs_{axis}.png")))

  with_arrivals = [(r, label) for r, label in zip(runs, labels) if r.arrivals]
  if not with_arrivals:
    return paths
  workers = lambda r: sorted({a["worker"] for a in r.arrivals})  # those that arrived

  fig, axes = _grid(plt, len(with_arrivals))
  for ax, (run, label) in zip(axes, with_arrivals):
    ids = workers(run)
    by_worker = [[a["staleness"] for a in run.arrivals if a["worker"] == w] for w in ids]
    top = max(a["staleness"] for a in run.arrivals)
    bins = np.arange(top + 2) - 0.5 if top < 100 else 100  # one bin per τ, or 100
    ax.hist(by_worker, bins=bins, stacked=True, label=[f"worker {w}" for w in ids])
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
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=7, loc="lower right")
    else:  # a rule without these diagnostics (e.g. cgad)
      ax.text(0.5, 0.5, "no cos(Δ, m) or branch rows", ha="center", va="center",
              transform=ax.transAxes, fontsize=8)
  paths.append(_save(plt, fig, os.path.join(out, "alignment.png")))

  fig, axes = _grid(plt, len(with_arrivals), height=0.6 + 0.45 * max(
      len(workers(r)) for r, _ in with_arrivals))
  for ax, (run, label) in zip(axes, with_arrivals):
    ids = workers(run)
    row = {w: i for i, w in enumerate(ids)}
    ax.scatter([a["sim_time"] for a in run.arrivals], [row[a["worker"]] for a in run.arrivals],
               c=[a["staleness"] for a in run.arrivals], cmap="viridis", s=90, marker="|",
               linewidths=2)
    ax.set_yticks(range(len(ids)), [str(w) for w in ids])
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
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      paths = plot(args.run_dirs, out)
  except ValueError as error:  # safe_files.LinkError too
    print(f"heloco-jax plot: {error}", file=sys.stderr)
    return 2
  except OSError as error:  # --out a file, a read-only file system, a full disk
    print(f"heloco-jax plot: cannot write to --out={out!r}: {error.strerror or error}",
          file=sys.stderr)
    return 2
  for warning in caught:
    if issubclass(warning.category, UserWarning) and "left out of the figures" in str(
        warning.message):
      print(f"heloco-jax plot: warning: {warning.message}", file=sys.stderr)
    else:  # a library's own (matplotlib's)
      warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
  for path in paths:
    print(path)
  return 0
