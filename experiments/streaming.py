"""RESULTS.md's sections of issue 34's grid (``grids.streaming_grid``), from its digests.

Five questions, each over the seeds a variant has (mean, and for differences with its
baseline the paired 95% CI of ``science.paired_ci``: Student's t, sample std):

1. Fragments: Streaming DiLoCo's peak bytes per sync against P at equal tokens, and its loss
   against DiLoCo's (P = 1).
2. Compression: final loss at equal tokens per compressor, with and without error feedback,
   for DiLoCo (homogeneous) and HeLoCo (severe), against float32.
3. Bandwidth: on a link where θ takes 4 s each way, the simulated time each variant takes to
   reach a target loss (the highest final mean loss of the variants: all reach it) and its
   loss at the time budget.
4. HeLoCo's branches under quantized pseudo-gradients: the share of blocks kept, rotated,
   shrunk or passed per compressor (the runs' trajectories differ, so this compares
   frequencies, not the same decisions on the same inputs).
5. ... and on the same inputs: how often a block's branch changes when Δ is quantized
   (``experiments.branches``).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  pylint: disable=g-import-not-at-top
import numpy as np  # noqa: E402

from experiments import analysis, branches, grids, science  # noqa: E402
from heloco_jax import outer  # noqa: E402

Result = analysis.Result


def _variant(result: Result) -> str:
  return result.run.name.split("/")[2]


def _by(results: Sequence[Result], question: str, method: str) -> dict[str, dict[int, Result]]:
  """variant -> seed -> result, of one question and method."""
  out: dict[str, dict[int, Result]] = {}
  for r in results:
    if r.run.table == question and r.run.method == method:
      out.setdefault(_variant(r), {})[r.run.seed] = r
  return out


def final(r: Result) -> float:
  return r.summary["final_val_loss"]


def _diff(variant: dict[int, Result], base: dict[int, Result]) -> str:
  """Paired (variant − baseline) final loss over the seeds both have: mean [95% CI]."""
  seeds = sorted(set(variant) & set(base))
  mean, low, high = science.paired_ci([final(variant[s]) - final(base[s]) for s in seeds])
  if math.isnan(mean):
    return "–"
  return f"{mean:+.3f}" + ("" if math.isnan(low) else f" [{low:+.3f}, {high:+.3f}]")


def fragments_table(results: Sequence[Result]) -> str:
  rows = _by(results, "fragments", "diloco")
  base = rows.get("p1", {})
  if not base:
    return ""
  base_peak = np.mean([r.summary["peak_bytes_per_sync"] for r in base.values()])
  lines = ["| variant | seeds | final val loss | − P = 1 (paired, 95% CI) | peak bytes per sync "
           "| ÷ P = 1's | bytes sent |", "|---|---|---|---|---|---|---|"]
  for name in ("p1", "p2", "p4", "p4_overlap"):
    if name not in rows:
      continue
    runs = list(rows[name].values())
    peak = np.mean([r.summary["peak_bytes_per_sync"] for r in runs])
    sent = np.mean([r.summary["bytes_sent"] for r in runs])
    lines.append(f"| {name} | {len(runs)} | {analysis.mean_std([final(r) for r in runs])} | "
                 f"{_diff(rows[name], base) if name != 'p1' else '–'} | {peak:,.0f} | "
                 f"{base_peak / peak:.2f}× less | {sent / 1e6:.1f} MB |")
  return "\n".join(lines)


def compression_table(results: Sequence[Result]) -> str:
  lines = ["| method (paces) | compressor | seeds | final val loss | − fp32 (paired, 95% CI) | "
           "bytes sent ÷ fp32's |", "|---|---|---|---|---|---|"]
  for method, preset in grids.COMPRESSION_PRESETS.items():
    rows = _by(results, "compression", method)
    base = rows.get("fp32", {})
    base_sent = np.mean([r.summary["bytes_sent"] for r in base.values()]) if base else math.nan
    for name, _ in grids.COMPRESSIONS:
      if name not in rows:
        continue
      runs = list(rows[name].values())
      sent = np.mean([r.summary["bytes_sent"] for r in runs])
      lines.append(f"| {method} ({preset}) | {name} | {len(runs)} | "
                   f"{analysis.mean_std([final(r) for r in runs])} | "
                   f"{_diff(rows[name], base) if name != 'fp32' and base else '–'} | "
                   f"{sent / base_sent:.3f} |")
  return "\n".join(lines) if len(lines) > 2 else ""


def time_to(result: Result, target: float) -> float:
  """The simulated time of the first evaluation at or below ``target`` (inf: never)."""
  return next((e["sim_time"] for e in result.evals if e["val_loss"] <= target), math.inf)


def bandwidth_table(results: Sequence[Result]) -> str:
  variants = {name: _by(results, "bandwidth", method).get(name, {})
              for name, method, _ in grids.BANDWIDTH_VARIANTS}
  variants = {name: runs for name, runs in variants.items() if runs}
  if not variants:
    return ""
  target = max(np.mean([final(r) for r in runs.values()]) for runs in variants.values())
  lines = [f"Target loss: {target:.3f} (the highest final mean loss of the variants).", "",
           "| variant | seeds | time to target (s, mean) | final val loss at the time budget | "
           "bytes sent | worker-seconds on the network |", "|---|---|---|---|---|---|"]
  for name, runs in variants.items():
    times = [time_to(r, target) for r in runs.values()]
    network = np.mean([r.summary.get("network_seconds", math.nan) for r in runs.values()])
    sent = np.mean([r.summary["bytes_sent"] for r in runs.values()])
    lines.append(f"| {name} | {len(runs)} | {np.mean(times):.0f} | "
                 f"{analysis.mean_std([final(r) for r in runs.values()])} | {sent / 1e6:.1f} MB | "
                 f"{network:.0f} |")
  return "\n".join(lines)


def branches_table(results: Sequence[Result]) -> str:
  rows = _by(results, "compression", "heloco")
  lines = ["| compressor | arrivals | " + " | ".join(outer.BRANCH_NAMES) + " |",
           "|---|---|" + "---|" * len(outer.BRANCH_NAMES)]
  for name, _ in grids.COMPRESSIONS:
    runs = rows.get(name, {})
    counts = {b: sum(sum(a.get(f"branch_count/{b}") or 0 for a in r.arrivals)
                     for r in runs.values()) for b in outer.BRANCH_NAMES}
    total = sum(counts.values())
    if not total:
      continue
    arrivals = sum(len(r.arrivals) for r in runs.values())
    lines.append(f"| {name} | {arrivals} | "
                 + " | ".join(f"{100 * counts[b] / total:.1f}%" for b in outer.BRANCH_NAMES)
                 + " |")
  return "\n".join(lines) if len(lines) > 2 else ""


def mean_curve(runs: Sequence[Result], x_key: str) -> tuple[np.ndarray, np.ndarray]:
  """(x, validation loss) at the evaluations, the mean over ``runs`` up to the shortest."""
  length = min(len(r.evals) for r in runs)
  xs = np.mean([[e[x_key] for e in r.evals[:length]] for r in runs], axis=0)
  ys = np.mean([[e["val_loss"] for e in r.evals[:length]] for r in runs], axis=0)
  return xs, ys


def figure(results: Sequence[Result], fig_dir: str) -> list[str]:
  """Validation loss against tokens (compression, per method) and against simulated time
  (bandwidth), the mean over seeds."""
  panels = [("compression", m, "tokens") for m in grids.COMPRESSION_PRESETS] + [
      ("bandwidth", None, "sim_time")]
  fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
  drawn = False
  for ax, (question, method, x_key) in zip(axes, panels):
    chosen = [r for r in results if r.run.table == question
              and (method is None or r.run.method == method)]
    for name in sorted({_variant(r) for r in chosen}):
      ax.plot(*mean_curve([r for r in chosen if _variant(r) == name], x_key), label=name)
      drawn = True
    ax.set_title(question if method is None else f"{question}: {method}")
    ax.set_xlabel("simulated s" if x_key == "sim_time" else "tokens")
    ax.set_ylabel("val loss")
    ax.legend(fontsize=7)
  if not drawn:
    plt.close(fig)
    return []
  os.makedirs(fig_dir, exist_ok=True)
  return [analysis._save(fig, os.path.join(fig_dir, "streaming.png"), dpi=100)]  # pylint: disable=protected-access


def sections(results: Sequence[Result], fig_dir: str, results_path: str) -> list[str]:
  """RESULTS.md's sections of issue 34's grid (its figure under ``fig_dir``; links relative to
  ``results_path``), and the shadowed HeLoCo runs of ``branches`` (their digests); nothing
  when no run is finished."""
  if not results:
    return []
  figures = figure(results, fig_dir)
  rel = lambda p: os.path.relpath(p, os.path.dirname(os.path.abspath(results_path)))
  core_hours = sum(r.summary.get("wall_seconds", 0.0) for r in results) / 3600
  scale = grids.STREAMING
  section = functools.partial(analysis._section, level=3)  # pylint: disable=protected-access
  return [
      "## Streaming and compression", "",
      f"Issue 34's grid (`--grid=streaming`, {len(results)} of "
      f"{len(grids.grid('streaming'))} runs finished, {core_hours:.1f} core-hours): "
      f"{scale.num_layers}-layer GPT, d_model {scale.d_model}, context {scale.context}, batch "
      f"{scale.batch_size}, H = {scale.inner_steps}, {scale.tokens:,} tokens per run, 5 "
      "workers, one synthetic language each; outer learning rates and momenta from "
      "ALGORITHMS.md. Means over seeds ± sample std; differences paired by seed with their "
      "95% CI (Student's t).", "",
      *section("Streaming DiLoCo: fragments at equal tokens", fragments_table(results),
               "DiLoCo at homogeneous paces, θ in P contiguous fragments, fragment p synced "
               "every H steps at offset p·H/P; p4_overlap: τ = 2 inner steps of overlap, "
               "α = 0.5."),
      *section("Compressed pseudo-gradients at equal tokens", compression_table(results),
               "_ef: with error feedback; top1pct: the 1% largest entries. HeLoCo's bytes "
               "include θ's downloads, which are not compressed."),
      *section("A bandwidth-limited link", bandwidth_table(results),
               f"Paces {grids.BANDWIDTH_PRESET}; θ in float32 takes 4 s each way "
               f"({grids.STREAMING_BANDWIDTH:,.0f} bytes/s); the time budget is the one in "
               "which non-waiting workers read the token budget. p4: 4 fragments, τ = 2, "
               "α = 0.5."),
      *section("HeLoCo's branches under compression", branches_table(results),
               "Share of blocks per branch over all arrivals of the compression runs "
               "(severe). The runs' trajectories differ, so these are frequencies, not the "
               "same decision on the same input: that is the next table."),
      *section("HeLoCo's branch on the same input, quantized", branches.table(branches.load()),
               "At every arrival of the fp32 HeLoCo runs above, the outer rule also ran from "
               "the same state on D(C(Δ)) of each compressor (no error feedback), and each "
               "block's branch was compared with its branch on Δ "
               "(`python -m experiments.branches`; the runs themselves are unchanged)."),
      *[f"![{os.path.basename(p)}]({rel(p)})" for p in figures], ""]
