"""experiments/eval_noise.py's estimators on synthetic curves of known noise: a smooth decay
plus Gaussian noise of known sd, evaluated as the claims runs are (every 5% of the budget), and
the window weights against science.loss_at."""

import dataclasses
import math

import numpy as np

from experiments import analysis, eval_noise, grids, science

_RUN = next(r for r in grids.grid("authors") if r.name == "authors/tokens/severe/mla/seed0")
_T = science.run_time_budget(_RUN)


def _smooth(f):
  """A validation-loss curve over the budget's fraction f: 7.66 at 0, about 6.2 at 1."""
  return 6.0 + 1.66 * np.exp(-2.5 * f)


def _result(losses, stretch=1.0, seed=0):
  """A time-table run with one evaluation every 5% of the budget (at ``stretch``·f·T)."""
  f = np.arange(21) / 20
  evals = [{"event": "eval", "sim_time": float(stretch * x * _T), "tokens": int(x * 2_560_000),
            "val_loss": float(y)} for x, y in zip(f, losses)]
  run = dataclasses.replace(_RUN, seed=seed)
  return analysis.Result(run, {"final_val_loss": float(losses[-1])}, evals)


def test_residual_sd_recovers_known_noise():
  rng = np.random.default_rng(0)
  x = np.linspace(0.5, 1.0, 12)
  for sigma in (0.01, 0.03, 0.1):
    quadratic = [eval_noise.residual_sd(x, _smooth(x) + rng.normal(0, sigma, x.size))
                 for _ in range(300)]
    second = [eval_noise.second_difference_sd(_smooth(x) + rng.normal(0, sigma, x.size))
              for _ in range(300)]
    assert abs(math.sqrt(np.mean(np.square(quadratic))) / sigma - 1) < 0.2
    assert abs(np.median(quadratic) / sigma - 1) < 0.2
    assert abs(math.sqrt(np.mean(np.square(second))) / sigma - 1) < 0.2
  # no noise: what the quadratic leaves of the decay is under 0.1% of the loss (the claims
  # runs' evaluation noise is about 0.5%)
  assert eval_noise.residual_sd(x, _smooth(x)) < 0.001 * 6.1


def test_window_weights_reproduce_the_window_mean():
  rng = np.random.default_rng(1)
  for stretch in (1.0, 1.003, 0.97):  # evaluations on the window's points, and between them
    losses = _smooth(np.arange(21) / 20) + rng.normal(0, 0.05, 21)
    result = _result(losses, stretch)
    w = eval_noise.window_weights(result)
    window = np.mean([science.loss_at(result, "time", f) for f in science.WINDOW_FRACTIONS])
    assert abs(w.sum() - 1) < 1e-9 and np.all(w >= 0)
    assert abs(float(w @ losses) - window) < 1e-9
  assert np.count_nonzero(eval_noise.window_weights(_result(losses, 1.0))) == 11


def test_pair_and_cell_noise_on_known_noise():
  """HeLoCo and MLA curves with independent relative noise σ: (a) ≈ σ, both (b) estimates
  ≈ 100·√2·σ/√11, and the variance fraction ≈ (b)² over the seeds' spread when the seeds'
  true gains are all equal (all the spread is noise)."""
  rng = np.random.default_rng(2)
  sigma, f = 0.005, np.arange(21) / 20
  pairs, gains = [], []
  for seed in range(100):
    mla = _smooth(f)
    heloco = mla * 0.99  # a true 1% gain on every seed
    noisy = [curve * (1 + rng.normal(0, sigma, 21)) for curve in (heloco, mla)]
    h, m = (_result(c, 1.0, seed) for c in noisy)
    pairs.append((h, m))
    gains.append(np.mean([100 * (science.loss_at(m, "time", x) - science.loss_at(h, "time", x))
                          / science.loss_at(m, "time", x) for x in science.WINDOW_FRACTIONS]))
  cell = eval_noise.cell_noise(pairs, gains)
  expected = 100 * math.sqrt(2) * sigma / math.sqrt(11)
  assert cell["evals"] == 11 and cell["seeds"] == 100
  assert abs(cell["sigma"] / sigma - 1) < 0.2
  assert abs(cell["independent"] / expected - 1) < 0.2
  assert abs(cell["paired"] / expected - 1) < 0.2
  assert abs(cell["seed_sd"] / expected - 1) < 0.2
  assert abs(cell["fraction_independent"] - 1) < 0.4 and abs(cell["fraction_paired"] - 1) < 0.4
  assert abs(cell["lag1"] - eval_noise.iid_lag1(11)) < 0.05


def test_decide_and_iid_lag1():
  small = {"fraction_independent": 0.2, "fraction_paired": 0.1}
  assert eval_noise.decide([("a", small), ("b", small)]) == "not built"
  assert eval_noise.decide([("a", small), ("b", {**small, "fraction_paired": 0.4})]) == "build"
  # 12 equally spaced independent values around a quadratic fit: lag-1 of -1/4 exactly
  assert abs(eval_noise.iid_lag1(12) + 0.25) < 1e-9


def test_run_noise_of_one_language():
  rng = np.random.default_rng(3)
  f = np.arange(21) / 20
  result = _result(_smooth(f))
  noisy = _smooth(f) * (1 + rng.normal(0, 0.03, 21))
  result.evals[:] = [{**e, "val_loss/de": float(y)} for e, y in zip(result.evals, noisy)]
  assert eval_noise.run_noise(result) < 0.001  # the mean loss: smooth
  assert eval_noise.run_noise(result, key="val_loss/de") > 0.015
  assert eval_noise.run_noise(result, key="val_loss/de") == eval_noise.run_noise(
      _result(noisy))


def test_pilot_runs_change_only_the_validation_set():
  runs = eval_noise.pilot_runs()
  assert [r.method for r in runs] == ["mla", "heloco"]
  for run in runs:
    grid = next(r for r in grids.grid("authors") if "val128/" + r.name == run.name)
    assert (run.table, run.preset, run.seed) == ("tokens", "severe", 0)
    changed = {k for k, v in run.overrides if dict(grid.overrides)[k] != v}
    assert changed == {"data.val_sequences_per_language"}
    assert dict(run.overrides)["data.val_sequences_per_language"] == 128
    assert dict(grid.overrides)["data.val_sequences_per_language"] == 32


def test_pilot_comparison_on_known_noise():
  """Pilot runs whose noise is half the committed runs' (the same draws × 0.5, as the
  validation set's sampling alone would give at 4× the sequences): ratios ≈ 0.5; the same
  noise: ≈ 1."""
  rng = np.random.default_rng(4)
  f = np.arange(21) / 20
  languages = grids.LANGUAGES.split(",")
  pilot_runs = {r.method: r for r in eval_noise.pilot_runs()}

  def run(method, seed, noise, scale, pilot=False):
    base = _smooth(f) * (0.99 if method == "heloco" else 1.0)
    result = _result(base * (1 + scale * noise[0]), 1.0, seed)
    result.evals[:] = [{**e, **{f"val_loss/{lang}": float(base[i] * (1 + scale * noise[1 + j][i]))
                                for j, lang in enumerate(languages)}}
                       for i, e in enumerate(result.evals)]
    run_ = pilot_runs[method] if pilot else dataclasses.replace(_RUN, method=method, seed=seed)
    return dataclasses.replace(result, run=run_)

  draws = {(m, s): rng.normal(0, 0.02, (6, 21)) for m in ("heloco", "mla") for s in range(3)}
  results = [run(m, s, draws[m, s], 1.0) for m, s in draws]
  for scale, expected in ((0.5, 0.5), (1.0, 1.0)):
    pilot = [run(m, 0, draws[m, 0], scale, pilot=True) for m in ("heloco", "mla")]
    c = eval_noise.pilot_comparison(results, pilot)
    assert (c["val_sequences"], c["base_sequences"], c["sampling_ratio"]) == (128, 32, 0.5)
    assert abs(c["ratio"] - expected) < 0.03 and abs(c["ratio_languages"] - expected) < 0.03
    assert 0.5 * expected < c["ratio_cell"] < 1.5 * expected
    assert abs(c["heloco"]["same_seed"] - c["heloco"]["seeds"][0]) < 1e-12
    for key in ("pooled", "pooled_languages"):
      assert c[key]["low"] < c[key]["ratio"] < c[key]["high"]
      assert 0.5 * expected < c[key]["ratio"] < 1.5 * expected
    assert abs(c["gain_pilot"] - 1.0) < 3 and abs(c["gain_same_seed"] - 1.0) < 3
  assert "sampling alone gives 0.50" in eval_noise.pilot_report(results, pilot)


def test_noise_ratio():
  old = [0.02, 0.03, 0.025] * 10
  same = eval_noise.noise_ratio(old, old, 9)
  assert abs(same["ratio"] - 1) < 1e-12 and same["low"] < 1 < same["high"]
  assert 0 < same["sampling_max"] < 0.3  # 270 degrees of freedom a side: a narrow interval
  half = eval_noise.noise_ratio([x / 2 for x in old], old, 9)  # sampling alone at 4x
  assert abs(half["ratio"] - 0.5) < 1e-12 and half["sampling_max"] == 1.0
  wide = eval_noise.noise_ratio(old[:2], old[:2], 9)  # 18 degrees of freedom: wider
  assert wide["low"] < same["low"] and wide["sampling_max"] > same["sampling_max"]
