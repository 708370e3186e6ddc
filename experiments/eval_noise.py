"""How much of the MLA severe cells' seed spread is evaluation noise (issue 81, item 5).

``python -m experiments.eval_noise`` reads the committed digests (experiments/results) and
prints, for the claims model and for every MLA claims row with a severe-paces cell:

(a) one evaluation's noise: the residual sd of a run's evaluations that the verdict's window
    reads (those with a weight in it, ``window_weights``: 12 of the 21 for the time table)
    around a quadratic in simulated time (``residual_sd``, n − 3 degrees of freedom), over the
    mean loss there; the median over runs. ``second_difference_sd`` is a cross-check that
    fits nothing.
(b) how much of it reaches the verdict's statistic, a seed's window gain (``science.window_gain``:
    100·(L_MLA − L_HeLoCo)/L_MLA averaged over 11 points of 50–100% of the time budget T):
    ``independent``, the issue's estimate, 100·√(σ_h² + σ_m²)/√n (= √2·σ/√n, n the evaluations
    the window reads), root mean square over the seeds; ``paired``, the residual sd of the seed's
    paired gain curve itself (HeLoCo's and MLA's evaluations fall at the same simulated times),
    times √(Σ w²) of the window's weights on the evaluations, which keeps what HeLoCo's and
    MLA's noise share.
(c) the seeds' spread of the window gains the verdict reads (sample sd, ddof 1).

The variance fraction is (b)² / (c)²: the share of the observed seed variance that evaluation
noise of that size would explain. A fraction above 1 says the noise estimate exceeds the spread
seen (3 or 5 seeds: the sample variance has 2 or 4 degrees of freedom). The decision rule
(issue 81, item 5): when every cell's fraction is below ``THRESHOLD`` under both estimates, a
larger validation set cannot make the cells robust and is not built; otherwise it should be.

What the digests cannot say: how much of the jitter is the validation set's sampling (the only
part a 4× set removes) and how much the model's own loss moving between evaluations (which no
validation set removes); the residual is an upper bound on the first's eval-to-eval part.
Each digest keeps the mean loss per evaluation and per language, not per sequence.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from typing import Any, Optional, Sequence

import numpy as np

from experiments import analysis, grids, science

Result = analysis.Result

THRESHOLD = 1 / 3  # the variance fraction below which evaluation noise is "a small share"
DEGREE = 2  # the smooth fit's polynomial degree
_HERE = os.path.dirname(os.path.abspath(__file__))


def residual_sd(x: Sequence[float], y: Sequence[float], degree: int = DEGREE) -> float:
  """The residual sd of ``y`` around its least-squares polynomial of ``degree`` in ``x``,
  √(RSS / (n − degree − 1)); NaN with no degree of freedom left."""
  x, y = np.asarray(x, float), np.asarray(y, float)
  if y.size <= degree + 1:
    return math.nan
  scaled = (x - x.mean()) / (np.ptp(x) or 1.0)
  residual = y - np.polyval(np.polyfit(scaled, y, degree), scaled)
  return float(math.sqrt(np.sum(residual ** 2) / (y.size - degree - 1)))


def second_difference_sd(y: Sequence[float]) -> float:
  """The noise sd of equally spaced ``y`` from its second differences, √(mean(Δ²y²) / 6)
  (independent noise of sd σ gives Var Δ²y = 6σ²; a smooth trend adds its curvature)."""
  d = np.diff(np.asarray(y, float), 2)
  return float(math.sqrt(np.mean(d ** 2) / 6)) if d.size else math.nan


def iid_lag1(n: int, degree: int = DEGREE) -> float:
  """The lag-1 autocorrelation that a polynomial fit of ``degree`` alone gives the residuals
  of ``n`` equally spaced independent values, tr(M·S)/tr(M) (M = I − the fit's hat matrix,
  S the shift by one): what ``pair_noise``'s ``lag1`` is for independent noise."""
  x = np.linspace(-0.5, 0.5, n)
  design = np.vander(x, degree + 1)
  m = np.eye(n) - design @ np.linalg.pinv(design)
  return float(np.trace(m @ np.eye(n, k=1)) / np.trace(m))


def window_weights(result: Result, table: str = "time",
                   fractions: Sequence[float] = science.WINDOW_FRACTIONS) -> np.ndarray:
  """w with Σ_i w_i·L_i = the window mean of ``result``'s validation loss (``science.loss_at``
  averaged over ``fractions``), one weight per evaluation: the window is linear in the
  evaluated losses, so each weight is the window mean of a curve that is 1 at that evaluation
  and 0 elsewhere."""
  n = len(result.evals)
  weights = np.zeros(n)
  for j in range(n):
    unit = [{**e, "val_loss": float(i == j)} for i, e in enumerate(result.evals)]
    if table == "tokens" and j == n - 1:
      summary = {**result.summary, "final_val_loss": 1.0}
    else:
      summary = {**result.summary, "final_val_loss": 0.0}
    probe = dataclasses.replace(result, evals=unit, summary=summary)
    weights[j] = np.mean([science.loss_at(probe, table, f) for f in fractions])
  return weights


def _window_curve(result: Result, table: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(simulated times, losses, window weights) of the evaluations the window reads."""
  w = window_weights(result, table)
  read = np.flatnonzero(w > 1e-12)
  times = np.array([result.evals[i]["sim_time"] for i in read])
  return times, np.array([result.evals[i]["val_loss"] for i in read]), w[read]


def run_noise(result: Result, table: str = "time", degree: int = DEGREE) -> float:
  """(a) of one run: the residual sd of the evaluations its window reads, over their mean."""
  times, loss, _ = _window_curve(result, table)
  return residual_sd(times, loss, degree) / float(loss.mean())


def run_noise_second_difference(result: Result, table: str = "time") -> float:
  """(a)'s cross-check: ``second_difference_sd`` of the same evaluations, over their mean."""
  _, loss, _ = _window_curve(result, table)
  return second_difference_sd(loss) / float(loss.mean())


def pair_noise(heloco: Result, mla: Result, table: str = "time",
               degree: int = DEGREE) -> dict[str, float]:
  """(b) of one seed's pair, in percentage points of the window gain: ``independent``
  (100·√(σ_h² + σ_m²)/√n) and ``paired`` (the paired gain curve's residual sd × √(Σ w²));
  also each run's relative noise and ``lag1``, the paired residuals' lag-1 autocorrelation."""
  times, h, w = _window_curve(heloco, table)
  m = np.interp(times, [e["sim_time"] for e in mla.evals], [e["val_loss"] for e in mla.evals])
  sigma_h = residual_sd(times, h, degree) / h.mean()
  sigma_m = run_noise(mla, table, degree)
  gain = 100 * (m - h) / m
  scaled = (times - times.mean()) / (np.ptp(times) or 1.0)
  residual = gain - np.polyval(np.polyfit(scaled, gain, degree), scaled)
  return {"sigma_heloco": sigma_h, "sigma_mla": sigma_m, "evals": int(times.size),
          "independent": 100 * math.sqrt(sigma_h ** 2 + sigma_m ** 2) / math.sqrt(times.size),
          "paired": residual_sd(times, gain, degree) * math.sqrt(float(np.sum(w ** 2))),
          "lag1": float(np.sum(residual[1:] * residual[:-1]) / np.sum(residual ** 2))}


def cell_noise(pairs: Sequence[tuple[Result, Result]], per_seed: Sequence[float],
               table: str = "time") -> dict[str, Any]:
  """One cell's (a), (b), (c) and variance fractions from its (HeLoCo, MLA) runs by seed and
  the window gains the verdict reads (``per_seed``, same order)."""
  found = [pair_noise(h, m, table) for h, m in pairs]
  rms = lambda key: math.sqrt(float(np.mean([f[key] ** 2 for f in found])))
  spread = float(np.std(per_seed, ddof=1)) if len(per_seed) > 1 else math.nan
  out = {"seeds": len(found), "evals": found[0]["evals"],
         "sigma": float(np.median([f[k] for f in found for k in ("sigma_heloco", "sigma_mla")])),
         "independent": rms("independent"), "paired": rms("paired"), "seed_sd": spread,
         "lag1": float(np.mean([f["lag1"] for f in found]))}
  for key in ("independent", "paired"):
    out[f"fraction_{key}"] = out[key] ** 2 / spread ** 2
  return out


def mla_severe_cells(results: Sequence[Result]) -> list[tuple[str, dict[str, Any]]]:
  """(row name, ``cell_noise``) of every severe-paces cell of the claims table's HeLoCo-vs-MLA
  rows that the verdict judges (``science.MIN_SEEDS`` seeds or more), on the seeds it reads."""
  out = []
  for row in science.heloco_rows(results):
    if row.baselines != ("mla",):
      continue
    for cell in row.cells()[0]:
      if cell["preset"] != "severe" or cell["seeds"] < science.MIN_SEEDS:
        continue  # a cell the verdict leaves pending has no seed spread to compare
      runs = {m: {r.run.seed: r for r in science.runs_for(row.runs, row.table, "severe", m)}
              for m in ("heloco", "mla")}
      pairs = [(runs["heloco"][s], runs["mla"][s]) for s in cell["seed_list"]]
      found = cell_noise(pairs, cell["per_seed"], row.table)
      out.append((row.name, {**found, "gain": cell["gain"], "low": cell["low"],
                             "high": cell["high"]}))
  return out


def claims_model_runs(results: Sequence[Result]) -> list[Result]:
  """The claims model's runs: the authors grid's token runs (2.1M parameters, the 20,480-token
  validation set: 5 languages × 32 sequences × 128 targets)."""
  return [r for r in results if r.run.name.startswith("authors/tokens/")]


def decide(cells: Sequence[tuple[str, dict[str, Any]]], threshold: float = THRESHOLD) -> str:
  """"not built" when every cell's variance fraction is below ``threshold`` under both
  estimates, else "build"."""
  small = all(c[f"fraction_{k}"] < threshold for _, c in cells for k in ("independent",
                                                                          "paired"))
  return "not built" if small else "build"


def report(results: Sequence[Result]) -> str:
  """The numbers (a), (b), (c), the variance fractions and the decision, as text."""
  model = claims_model_runs(results)
  quadratic = [run_noise(r, "tokens") for r in model]
  second = [run_noise_second_difference(r, "tokens") for r in model]
  by_preset = ", ".join(
      f"{p} {100 * np.median([q for q, r in zip(quadratic, model) if r.run.preset == p]):.2f}%"
      for p in grids.AUTHORS_PRESETS)
  lines = [f"(a) one evaluation's noise, claims model ({len(model)} token runs of the authors "
           f"grid, the 11 evaluations at 50-100% of the tokens): median "
           f"{100 * np.median(quadratic):.2f}% of the loss (quadratic fit), "
           f"{100 * np.median(second):.2f}% (second differences); by paces: {by_preset}", "",
           "MLA severe cells: (a) median over the cell's runs; (b) the window gain's evaluation "
           "noise, pp (independent: sqrt2*sigma/sqrt(n); paired: the gain curve's own residual); "
           "(c) the seeds' sd of the window gains, pp; fraction = (b)^2/(c)^2"]
  cells = mla_severe_cells(results)
  for name, c in cells:
    lines.append(
        f"- {name}: seeds {c['seeds']}, window {c['gain']:+.2f}% [{c['low']:+.2f}, "
        f"{c['high']:+.2f}]; (a) {100 * c['sigma']:.2f}% (n {c['evals']}); (b) independent "
        f"{c['independent']:.3f}, paired {c['paired']:.3f}; (c) {c['seed_sd']:.3f}; fraction "
        f"independent {c['fraction_independent']:.2f}, paired {c['fraction_paired']:.2f}; "
        f"paired residuals' lag-1 autocorrelation {c['lag1']:+.2f} (independent noise: "
        f"{iid_lag1(c['evals']):+.2f})")
  above = {k: sum(c[f"fraction_{k}"] >= THRESHOLD for _, c in cells)
           for k in ("independent", "paired")}
  lines += ["", f"cells with fraction >= {THRESHOLD:.2f}: {above['independent']} of {len(cells)} "
            f"(independent), {above['paired']} of {len(cells)} (paired)",
            "decision: " + ("build a >= 4x validation set" if decide(cells) == "build" else
                            "a >= 4x validation set is not built")
            + f" (not built only when every cell is below {THRESHOLD:.2f} under both estimates)"]
  return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--results", default=os.path.join(_HERE, "results"),
                      help="the digests' folder (default: experiments/results)")
  args = parser.parse_args(argv)
  results = analysis.load(os.devnull, grids.family("science"), args.results)  # digests only
  print(report(results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
