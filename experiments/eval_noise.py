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

The pilot that splits them (``pilot_runs``: the authors' severe seed-0 HeLoCo and MLA runs
with 4× the validation sequences, ``--pilot=OUT --run-pilot --corpus=DIR`` runs them;
``--pilot=OUT`` compares them with the committed runs, ``pilot_comparison``): the validation
set's sampling alone would halve (a) (√(32/128)); the model's own movement alone would leave
it where it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from typing import Any, Optional, Sequence

import numpy as np
from scipy import stats

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


def _window_curve(result: Result, table: str,
                  key: str = "val_loss") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(simulated times, losses, window weights) of the evaluations the window reads; ``key``:
  the evaluation's field (``val_loss/de``: one language's)."""
  w = window_weights(result, table)
  read = np.flatnonzero(w > 1e-12)
  times = np.array([result.evals[i]["sim_time"] for i in read])
  return times, np.array([result.evals[i][key] for i in read]), w[read]


def run_noise(result: Result, table: str = "time", degree: int = DEGREE,
              key: str = "val_loss") -> float:
  """(a) of one run: the residual sd of the evaluations its window reads, over their mean
  (``key``: of one language's loss, ``val_loss/de``)."""
  times, loss, _ = _window_curve(result, table, key)
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


# The pilot (issue 81, item 5): one pair at 4× the validation sequences, to tell the validation
# set's sampling from the model's own movement, which the digests cannot split.
PILOT_VAL_SEQUENCES = 128  # the claims model's data.val_sequences_per_language is 32
PILOT_METHODS = ("heloco", "mla")


def pilot_runs(val_sequences: int = PILOT_VAL_SEQUENCES, seeds: Sequence[int] = (0,),
               preset: str = "severe") -> list[grids.Run]:
  """The pilot's runs: the authors grid's HeLoCo and MLA token runs at ``preset`` (what the
  time row reads, ``science.runs_for``) with only ``data.val_sequences_per_language`` changed,
  named ``val<N>/`` + the grid's name."""
  out = []
  for run in grids.authors_grid(seeds=seeds):
    if (run.table, run.preset) != ("tokens", preset) or run.method not in PILOT_METHODS:
      continue
    overrides = {**dict(run.overrides), "data.val_sequences_per_language": val_sequences}
    out.append(dataclasses.replace(run, name=f"val{val_sequences}/{run.name}",
                                   overrides=tuple(overrides.items())))
  return out


def noise_ratio(new: Sequence[float], old: Sequence[float], dof: int,
                level: float = 0.95) -> dict[str, float]:
  """The ratio of two sets of residual sds pooled as root mean squares (``new`` over ``old``,
  each with ``dof`` degrees of freedom), its ``level`` interval by the F distribution (as if
  the residuals were independent), and ``sampling_max``: the largest share of ``old``'s
  residual variance that could be the validation set's sampling, which a 4× set cuts to a
  quarter (ratio² = 1 − ¾·share), at the interval's low end."""
  f = float(np.mean(np.square(new)) / np.mean(np.square(old)))
  d1, d2, tail = dof * len(new), dof * len(old), (1 - level) / 2
  low, high = f / stats.f.ppf(1 - tail, d1, d2), f / stats.f.ppf(tail, d1, d2)
  return {"ratio": math.sqrt(f), "low": math.sqrt(low), "high": math.sqrt(high),
          "sampling_max": float(min(1.0, max(0.0, (1 - low) / 0.75)))}


def _val_sequences(result: Result) -> int:
  return int(dict(result.run.overrides)["data.val_sequences_per_language"])


def pilot_comparison(results: Sequence[Result], pilot: Sequence[Result],
                     table: str = "time") -> dict[str, Any]:
  """The pilot's runs (``pilot``) against the same cell's runs in ``results`` (the committed
  digests): per method, (a) of the pilot run (``pilot``) and of the same seed's run
  (``same_seed``), that cell's (a) over its seeds (``seeds``: seed -> value) and the median
  over the five languages of each language's (a) (``*_languages``); per seed, the window gain
  (``science.window_gain``) and ``pair_noise`` of the pilot pair and of the same seed's pair.
  ``ratio``: the pilot's (a) over the same seed's, HeLoCo's and MLA's pooled as root mean
  squares (the validation set's sampling alone: √(32/128) = 0.5; the model's own movement
  alone: 1); ``ratio_cell``: over the cell's, all its seeds' runs pooled (the pilot's
  trajectory is not the same seed's: 128 sequences also take 96 per language out of
  training)."""
  preset, seed = pilot[0].run.preset, pilot[0].run.seed
  languages = [f"val_loss/{lang}" for lang in grids.LANGUAGES.split(",")]
  lang = lambda r: float(np.median([run_noise(r, table, key=k) for k in languages]))
  own = {m: {r.run.seed: r for r in science.runs_for(results, table, preset, m)}
         for m in PILOT_METHODS}
  new = {r.run.method: r for r in pilot}
  out: dict[str, Any] = {"preset": preset, "seed": seed, "val_sequences": _val_sequences(pilot[0]),
                         "base_sequences": _val_sequences(own["mla"][seed])}
  for m in PILOT_METHODS:
    out[m] = {"pilot": run_noise(new[m], table), "same_seed": run_noise(own[m][seed], table),
              "seeds": {s: run_noise(r, table) for s, r in sorted(own[m].items())},
              "pilot_languages": lang(new[m]), "same_seed_languages": lang(own[m][seed]),
              "seeds_languages": {s: lang(r) for s, r in sorted(own[m].items())}}
  rms = lambda key: math.sqrt(np.mean([out[m][key] ** 2 for m in PILOT_METHODS]))
  cell = lambda key: math.sqrt(np.mean([v ** 2 for m in PILOT_METHODS
                                        for v in out[m][key].values()]))
  out["ratio"] = rms("pilot") / rms("same_seed")
  out["ratio_languages"] = rms("pilot_languages") / rms("same_seed_languages")
  out["ratio_cell"] = rms("pilot") / cell("seeds")
  out["ratio_cell_languages"] = rms("pilot_languages") / cell("seeds_languages")
  out["sampling_ratio"] = math.sqrt(out["base_sequences"] / out["val_sequences"])
  cell_runs = [r for m in PILOT_METHODS for r in own[m].values()]
  dof = len(_window_curve(pilot[0], table)[0]) - DEGREE - 1
  for name, keys in (("pooled", ["val_loss"]), ("pooled_languages", languages)):
    out[name] = noise_ratio([run_noise(r, table, key=k) for r in pilot for k in keys],
                            [run_noise(r, table, key=k) for r in cell_runs for k in keys], dof)
  out["gain_pilot"] = science.window_gain(pilot, table, preset, "mla")["gain"]
  out["gain_same_seed"] = science.window_gain(results, table, preset, "mla", seeds=[seed])["gain"]
  out["pair_pilot"] = pair_noise(new["heloco"], new["mla"], table)
  out["pair_same_seed"] = pair_noise(own["heloco"][seed], own["mla"][seed], table)
  return out


def pilot_report(results: Sequence[Result], pilot: Sequence[Result]) -> str:
  """``pilot_comparison`` as text."""
  c = pilot_comparison(results, pilot)
  pct = lambda xs: ", ".join(f"{100 * x:.2f}" for x in xs)
  lines = [f"pilot: {c['preset']} paces, seed {c['seed']}, {c['val_sequences']} validation "
           f"sequences per language against {c['base_sequences']}; (a) in % of the loss"]
  for m in PILOT_METHODS:
    d = c[m]
    lines.append(
        f"- {m}: (a) {100 * d['pilot']:.2f}% ({c['base_sequences']} sequences: same seed "
        f"{100 * d['same_seed']:.2f}%; seeds {pct(d['seeds'].values())}); one language's (a), "
        f"median of 5: {100 * d['pilot_languages']:.2f}% (same seed "
        f"{100 * d['same_seed_languages']:.2f}%; seeds {pct(d['seeds_languages'].values())})")
  p, q = c["pair_pilot"], c["pair_same_seed"]
  lines += [f"ratio of (a), pilot / {c['base_sequences']} sequences (HeLoCo and MLA pooled as "
            f"root mean squares): same seed {c['ratio']:.2f} (mean loss), "
            f"{c['ratio_languages']:.2f} (one language's); the cell's seeds "
            f"{c['ratio_cell']:.2f} (mean loss), {c['ratio_cell_languages']:.2f} (one "
            f"language's); sampling alone gives {c['sampling_ratio']:.2f}, the model's own "
            "movement alone 1",
            *(f"pooled, {what}: the pilot's runs against the cell's, ratio "
              f"{c[k]['ratio']:.2f} (95% F interval {c[k]['low']:.2f}-{c[k]['high']:.2f}, "
              f"residuals taken as independent): the validation set's sampling is at most "
              f"{100 * c[k]['sampling_max']:.0f}% of the residual variance at "
              f"{c['base_sequences']} sequences"
              for k, what in (("pooled", "the mean loss"),
                              ("pooled_languages", "each language's loss (5 series a run)"))),
            f"window gain: pilot {c['gain_pilot']:+.3f}%, same seed {c['gain_same_seed']:+.3f}%; "
            f"its evaluation noise (b), pp: independent {p['independent']:.3f} (same seed "
            f"{q['independent']:.3f}), paired {p['paired']:.3f} (same seed {q['paired']:.3f})"]
  return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--results", default=os.path.join(_HERE, "results"),
                      help="the digests' folder (default: experiments/results)")
  parser.add_argument("--pilot", default="",
                      help="the pilot's folder (pilot_runs: OUT/runs, digests in OUT/digests): "
                      "compare its runs with the committed ones instead")
  parser.add_argument("--run-pilot", action="store_true",
                      help="first run the pilot's runs missing from --pilot (one at a time, as "
                      "experiments.reproduce runs a grid's; needs --corpus)")
  parser.add_argument("--corpus", default="", help="the authors grid's corpus folder")
  args = parser.parse_args(argv)
  results = analysis.load(os.devnull, grids.family("science"), args.results)  # digests only
  if not args.pilot:
    print(report(results))
    return 0
  runs, digests = pilot_runs(), os.path.join(args.pilot, "digests")
  if args.run_pilot:
    from experiments import reproduce  # pylint: disable=g-import-not-at-top
    todo = [r for r in runs if not os.path.exists(analysis.digest_path(digests, r))]
    if todo and reproduce.run_parallel(todo, args.pilot, args.corpus, digests, jobs=1,
                                       prune=True) != 0:
      return 1
  pilot = analysis.load(args.pilot, runs, digests)
  if len(pilot) < len(runs):
    print(f"eval_noise: {len(pilot)} of the pilot's {len(runs)} runs have finished in "
          f"{args.pilot}", file=sys.stderr)
    return 1
  print(pilot_report(results, pilot))
  return 0


if __name__ == "__main__":
  sys.exit(main())
