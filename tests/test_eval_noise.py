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
