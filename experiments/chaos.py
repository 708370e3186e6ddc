"""RESULTS.md's section of issue 35's chaos harness (``grids.chaos_grid``), from its digests.

Every method at equal simulated time, undisturbed and under one seeded failure schedule per
seed (the asynchronous methods also with Decoupled DiLoCo's merge, ``grids.CHAOS_SYNCER``):

* goodput: applied tokens ÷ tokens computed (applied, rejected and dropped with a worker
  that left; docs/FAILURES.md);
* time to target: the simulated time of the first evaluation at or below the target loss,
  the median of the undisturbed methods' final mean losses;
* final loss at the time budget, and its paired difference (by seed) with the method's
  undisturbed run: the mean and its 95% CI (``science.paired_ci``).
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  pylint: disable=g-import-not-at-top
import numpy as np  # noqa: E402

from experiments import analysis, grids, science, streaming  # noqa: E402

Result = analysis.Result
CONDITIONS = tuple(name for name, *_ in grids.CHAOS_CONDITIONS)
# What each condition is paired with: the same merge undisturbed (failures' cost), and the
# syncer undisturbed with the plain merge (what the syncer changes by itself).
BASELINES = {"failures": "undisturbed", "undisturbed_syncer": "undisturbed",
             "failures_syncer": "undisturbed_syncer"}


def _by(results: Sequence[Result]) -> dict[tuple[str, str], dict[int, Result]]:
  """(method, condition) -> seed -> result."""
  out: dict[tuple[str, str], dict[int, Result]] = {}
  for r in results:
    out.setdefault((r.run.method, r.run.table), {})[r.run.seed] = r
  return out


def target(results: Sequence[Result]) -> float:
  """The median of the undisturbed methods' final mean losses (NaN: none finished): half of
  them reach it undisturbed."""
  runs = _by(results)
  finals = [np.mean([streaming.final(r) for r in runs[(m, "undisturbed")].values()])
            for m in grids.CHAOS_METHODS if (m, "undisturbed") in runs]
  return float(np.median(finals)) if finals else math.nan


def _goodput(r: Result) -> float:
  return r.summary.get("goodput", 1.0)  # an undisturbed run drops nothing


def _time(times: Sequence[float]) -> str:
  reached = [t for t in times if math.isfinite(t)]
  if len(reached) < len(times):
    return f"{np.mean(reached):.0f} ({len(reached)}/{len(times)} reach it)" if reached else \
        f"not reached (0/{len(times)})"
  return f"{np.mean(reached):.0f}"


def table(results: Sequence[Result]) -> str:
  runs = _by(results)
  goal = target(results)
  if not runs or math.isnan(goal):
    return ""
  lines = [f"Target loss: {goal:.3f} (the median of the undisturbed methods' final mean "
           "losses).",
           "", "| method | condition | seeds | goodput | time to target (s) | final val loss | "
           "− final val loss of (paired, 95% CI) |", "|---|---|---|---|---|---|---|"]
  for method in grids.CHAOS_METHODS:
    for condition in CONDITIONS:
      cell = runs.get((method, condition))
      if not cell:
        continue
      finals = [streaming.final(r) for r in cell.values()]
      diff = "–"
      if condition in BASELINES:
        base = runs.get((method, BASELINES[condition]), {})
        paired = [streaming.final(r) - streaming.final(base[s]) for s, r in cell.items()
                  if s in base]
        if paired:
          mean, low, high = science.paired_ci(paired)
          diff = f"{BASELINES[condition]}: {mean:+.3f}" + (
              f" [{low:+.3f}, {high:+.3f}]" if math.isfinite(low) else "")
      lines.append(
          f"| {method} | {condition} | {len(cell)} | "
          f"{np.mean([_goodput(r) for r in cell.values()]):.3f} | "
          f"{_time([streaming.time_to(r, goal) for r in cell.values()])} | "
          f"{analysis.mean_std(finals)} | {diff} |")
  return "\n".join(lines)


def figure(results: Sequence[Result], fig_dir: str) -> list[str]:
  """Validation loss against simulated time per method, one line per condition (the mean
  over seeds)."""
  runs = _by(results)
  methods = [m for m in grids.CHAOS_METHODS if any((m, c) in runs for c in CONDITIONS)]
  if not methods:
    return []
  fig, axes = plt.subplots(2, math.ceil(len(methods) / 2), figsize=(4.5 * math.ceil(
      len(methods) / 2), 7), squeeze=False, sharey=True)
  for ax, method in zip(axes.flat, methods):
    for condition in CONDITIONS:
      cell = list(runs.get((method, condition), {}).values())
      if not cell:
        continue
      ax.plot(*streaming.mean_curve(cell, "sim_time"), label=condition)
    ax.set_title(method)
    ax.set_xlabel("simulated s")
    ax.set_ylabel("val loss")
    ax.legend(fontsize=7)
  for ax in list(axes.flat)[len(methods):]:
    ax.set_visible(False)
  os.makedirs(fig_dir, exist_ok=True)
  return [analysis._save(fig, os.path.join(fig_dir, "chaos.png"), dpi=100)]  # pylint: disable=protected-access


def sections(results: Sequence[Result], fig_dir: str, results_path: str) -> list[str]:
  """RESULTS.md's chaos section (its figure under ``fig_dir``; the link relative to
  ``results_path``); nothing when no run is finished."""
  body = table(results)
  if not body:
    return []
  figures = figure(results, fig_dir)
  rel = lambda p: os.path.relpath(p, os.path.dirname(os.path.abspath(results_path)))
  core_hours = sum(r.summary.get("wall_seconds", 0.0) for r in results) / 3600
  scale, seconds = grids.CHAOS, grids.time_budget(grids.CHAOS, grids.CHAOS_PRESET)
  syncer = ", ".join(f"{k.split('.')[1]} {v}" for k, v in grids.CHAOS_SYNCER.items())
  return [
      "## Training that survives its workers: the chaos harness", "",
      f"Issue 35's grid (`--grid=chaos`, {len(results)} of {len(grids.grid('chaos'))} runs "
      f"finished, {core_hours:.1f} core-hours): the streaming grid's GPT "
      f"({scale.num_layers} layers, d_model {scale.d_model}, H = {scale.inner_steps}), 5 "
      f"workers at {grids.CHAOS_PRESET} paces, {seconds:.0f} simulated seconds each (the time "
      f"in which non-waiting workers read {scale.tokens:,} tokens). *failures*: one seeded "
      f"schedule per seed, the same for every method (`chaos.rate` = "
      f"{grids.CHAOS_FAILURES:g} failures per worker per budget, `chaos.downtime` = "
      f"{grids.CHAOS_DOWNTIME:g} of it on average; docs/FAILURES.md). *_syncer*: with "
      f"Decoupled DiLoCo's merge ({syncer}; every arrival trains on the same tokens here, so "
      "token weights equal the mean), undisturbed and under the same failures; the last "
      "column pairs each condition by seed with the one it names. DDP and DiLoCo run elastic "
      "steps and "
      "rounds: a worker that leaves loses its part of the step or round in progress. Means "
      "over seeds ± sample std.", "",
      body, "",
      *[f"![chaos]({rel(p)})" for p in figures], "",
  ]
