"""hj.aggregate (heloco_jax/training/aggregate.py; ALGORITHMS.md, "Aggregation"): each rule against a
float64 NumPy reference written from the docs, the refusals, the default's bits and one
worker of six doing gradient ascent through its own loss_fn."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import heloco_jax as hj

A = hj.aggregate


# ------------------------------------------------ float64 references (ALGORITHMS.md)

def _median(x):
  n = len(x)
  s = np.sort(x, axis=0)
  return 0.5 * (s[(n - 1) // 2] + s[n // 2])


def ref_mean(x, w):
  return np.tensordot(w / w.sum(), x, axes=1)


def ref_trimmed(x, f):
  n = len(x)
  g = min(f, (n - 1) // 2)
  return np.sort(x, axis=0)[g:n - g].mean(axis=0)


def ref_norm_clip(x, w, bound):
  norms = np.sqrt((x.reshape(len(x), -1) ** 2).sum(axis=1))
  limit = bound * _median(norms)
  scale = np.minimum(1.0, limit / np.maximum(norms, 1e-300))
  return np.tensordot(w / w.sum() * scale, x, axes=1)


def ref_centered_clip(x, w, tau, iters):
  w = w / w.sum()
  v = _median(x)
  for _ in range(iters):
    d = x - v
    norms = np.sqrt((d.reshape(len(x), -1) ** 2).sum(axis=1))
    v = v + np.tensordot(w * np.minimum(1.0, tau / np.maximum(norms, 1e-300)), d, axes=1)
  return v


def _arrivals(n=5, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 3, 4))
  x[1] *= 40.0  # an outlier
  return x


@pytest.mark.parametrize("rule, reference", [
    (A.mean(), lambda x, w: ref_mean(x, w)),
    (A.median(), lambda x, w: _median(x)),
    (A.trimmed_mean(1), lambda x, w: ref_trimmed(x, 1)),
    (A.trimmed_mean(2), lambda x, w: ref_trimmed(x, 2)),
    (A.norm_clip(1.5), lambda x, w: ref_norm_clip(x, w, 1.5)),
    (A.centered_clip(0.5, 4), lambda x, w: ref_centered_clip(x, w, 0.5, 4)),
])
@pytest.mark.parametrize("masked", [False, True])
def test_each_rule_matches_its_float64_reference(rule, reference, masked):
  x = _arrivals(6)
  w = np.array([1.0, 2.0, 1.0, 3.0, 1.0, 2.0])
  if masked:  # a rejected row (weight 0) holding NaN is left out
    x[4] = np.nan
    w[4] = 0.0
  keep = w > 0
  got = A.combine(rule, {"a": jnp.asarray(x, jnp.float32)}, jnp.asarray(w / w.sum()))["a"]
  want = reference(x[keep], w[keep])
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
  assert not np.allclose(want, ref_mean(x[keep], w[keep])) or isinstance(rule, A.Mean)


@pytest.mark.parametrize("f", [1, 2])
def test_the_trimmed_mean_of_at_most_2f_plus_2_is_the_median_bit_for_bit(f):
  """ALGORITHMS.md: with n ≤ 2f + 2 both keep the middle one or two (the faulty grid runs
  one of them for both at quorum 2f + 1); one more and they part."""
  x = _arrivals(2 * f + 4, seed=f).astype(np.float32)
  for n in range(1, 2 * f + 4):
    for rejected in ([], [0]) if n > 1 else ([],):  # a rejected row (NaN) is left out
      w = np.ones(len(x), np.float32)
      w[n:] = 0.0
      w[rejected] = 0.0
      rows = x.copy()
      rows[w == 0] = np.nan
      stacked, weights = {"a": jnp.asarray(rows)}, jnp.asarray(w / w.sum())
      trimmed = np.asarray(A.combine(A.trimmed_mean(f), stacked, weights)["a"])
      median = np.asarray(A.combine(A.median(), stacked, weights)["a"])
      if w.sum() <= 2 * f + 2:
        np.testing.assert_array_equal(trimmed, median)
      else:
        assert not np.allclose(trimmed, median)


def test_a_round_with_a_rule_combines_theta_minus_each_end():
  theta = np.ones((3, 4))
  ends = _arrivals(5)
  accepted = np.array([True, True, False, True, True])
  got = A.round_delta(A.median(), {"a": jnp.asarray(theta, jnp.float32)},
                      {"a": jnp.asarray(ends, jnp.float32)}, jnp.asarray(accepted))["a"]
  np.testing.assert_allclose(np.asarray(got), _median(theta[None] - ends[accepted]), rtol=1e-6,
                             atol=1e-6)


def test_the_mean_is_todays_two_forms():
  x = _arrivals(4).astype(np.float32)
  accepted = np.array([True, False, True, True])
  got = A.accepted_mean({"a": jnp.asarray(x)}, jnp.asarray(accepted))["a"]
  np.testing.assert_allclose(np.asarray(got), x[accepted].mean(axis=0), rtol=1e-6)
  summed = A.weighted_sum([{"a": jnp.asarray(v)} for v in x], [0.25] * 4)["a"]
  np.testing.assert_allclose(np.asarray(summed), x.mean(axis=0), rtol=1e-6)


def test_the_screen_rejects_or_clips_against_the_median_of_history():
  history = [1.0, 3.0, 2.0, 10.0]  # median 2.5
  rule = A.screen(norm=2.0, warmup=4)
  assert rule.verdict(4.9, None, history) == (None, 1.0)
  assert rule.verdict(6.0, None, history) == ("norm", 1.0)
  assert rule.verdict(6.0, None, history[:3]) == (None, 1.0)  # warm-up: accepted
  reason, factor = A.screen(norm=2.0, action="clip").verdict(10.0, None, history)
  assert reason is None and factor == pytest.approx(0.5)
  cosine = A.screen(norm=None, cosine=-0.2)
  assert cosine.verdict(1.0, -0.5, history) == ("cosine", 1.0)
  assert cosine.verdict(1.0, -0.1, history) == (None, 1.0)


def test_rules_print_as_they_parse():
  for rule in (A.mean(), A.median(), A.trimmed_mean(2), A.centered_clip(0.5, 2),
               A.norm_clip(3.0), A.screen(norm=2.0, cosine=-0.1, action="clip")):
    assert A.parse(repr(rule)) == rule
  with pytest.raises(ValueError, match="aggregate='mode' is not allowed"):
    A.parse("mode")


# ------------------------------------------------ runs through the public API

K, D = 6, 8
_W = np.random.default_rng(0).normal(size=(D, 1)).astype(np.float32)
_XV = np.random.default_rng(1).normal(size=(256, D)).astype(np.float32)


class _stream:  # pylint: disable=invalid-name  (re-iterable: a resumed run reads it anew)
  def __init__(self, i, ascent):
    self.i, self.ascent = i, ascent

  def __iter__(self):
    rng = np.random.default_rng(10 + self.i)
    while True:
      x = rng.normal(size=(16, D)).astype(np.float32)
      yield {"x": x, "y": x @ _W + 0.01 * rng.normal(size=(16, 1)).astype(np.float32),
             "sign": np.float32(-1.0 if self.ascent else 1.0)}


def _loss(p, b):  # a faulty worker's batches carry sign = -1: it ascends its own loss
  return b["sign"] * jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)


def _val(p):
  return float(np.mean((_XV @ np.asarray(p["w"]) + np.asarray(p["b"]) - _XV @ _W) ** 2))


def _run(method, faulty, syncer=None, steps=1200, lr=0.08, speeds="homogeneous", **options):
  params = {"w": jnp.zeros((D, 1)), "b": jnp.zeros(1)}
  result = hj.simulate(_loss, params, [_stream(i, faulty and i == 0) for i in range(K)],
                       method=method, budget=hj.Budget(steps=steps), inner_steps=10,
                       speeds=speeds, inner_tx=optax.sgd(lr), syncer=syncer, **options)
  return _val(result.params), result


HELOCO = dict(lr=0.05, speeds=[1.0, 1.1, 1.2, 1.3, 1.4, 1.5],
              method_options={"learning_rate": 0.3})


@pytest.mark.parametrize("method, options, quorum, robust", [
    ("diloco", {}, 1, A.trimmed_mean(1)),
    ("heloco", HELOCO, 3, A.median()),
])
def test_one_worker_ascending_is_survived_by_a_robust_rule(method, options, quorum, robust):
  clean, _ = _run(method, False, hj.Syncer(quorum=quorum), **options)
  poisoned, _ = _run(method, True, hj.Syncer(quorum=quorum), **options)
  guarded, _ = _run(method, True, hj.Syncer(quorum=quorum, aggregate=robust), **options)
  assert poisoned >= 1.5 * clean, (clean, poisoned)
  assert guarded <= 1.25 * clean, (clean, guarded)


def test_an_explicit_mean_is_the_default_run_bit_for_bit():
  for method, syncer in (("diloco", hj.Syncer()), ("heloco", hj.Syncer(quorum=2))):
    _, plain = _run(method, True, syncer, steps=240)
    _, same = _run(method, True, dataclasses.replace(syncer, aggregate=A.mean()), steps=240)
    assert all(np.array_equal(a, b) for a, b in zip(
        np.asarray(plain.params["w"]).ravel(), np.asarray(same.params["w"]).ravel()))
    assert plain.history == same.history


def test_the_screen_rejects_arrivals_in_rows_and_redispatches():
  _, result = _run("heloco", True, hj.Syncer(aggregate=A.screen(norm=2.0)), steps=600,
                   **HELOCO)
  rejected = [r for r in result.history if r["event"] == "rejected"]
  assert rejected and {r["reason"] for r in rejected} == {"norm"}
  assert {r["worker"] for r in rejected} == {0}  # the ascending worker only
  arrivals = [r for r in result.history if r["event"] == "arrival" and r["worker"] == 0]
  assert arrivals  # re-dispatched after each rejection, some accepted
  assert result.summary["rejected"] == len(rejected)
  assert result.summary["rejected_by"] == {"norm": len(rejected)}


def test_a_screened_run_resumes_with_its_history_bit_for_bit(tmp_path, monkeypatch):
  """The screen's accepted norms are checkpointed (``OuterServer.history``): a run stopped
  after its checkpoint at 10 outer updates and resumed by the same call ends as the
  uninterrupted run, rejections included; with the history dropped it would not."""
  syncer = hj.Syncer(aggregate=A.screen(norm=2.0))

  def stop_at_the_25th_arrival(row):
    if row["event"] == "arrival" and row["outer_updates"] == 25:
      raise KeyboardInterrupt("stopped from outside")

  def run(workdir, **options):
    return _run("heloco", True, syncer, steps=400, **HELOCO,
                workdir=hj.Workdir(str(workdir), checkpoint_every=10), **options)
  _, whole = _run("heloco", True, syncer, steps=400, **HELOCO)
  for name, forget in (("kept", False), ("forgotten", True)):
    with pytest.raises(KeyboardInterrupt):
      run(tmp_path / name, on_row=stop_at_the_25th_arrival)
    if forget:  # what resuming did before the history was checkpointed
      monkeypatch.setattr(hj.Server, "set_history", lambda self, norms: None)
    _, resumed = run(tmp_path / name)
    same = (np.array_equal(np.asarray(resumed.params["w"]), np.asarray(whole.params["w"]))
            and resumed.summary["rejected"] == whole.summary["rejected"])
    assert same != forget, (name, resumed.summary["rejected"], whole.summary["rejected"])
  assert whole.summary["rejected"] > 0


@pytest.mark.parametrize("method, syncer, message", [
    ("diloco", hj.Syncer(aggregate=A.trimmed_mean(3)),
     "syncer.aggregate.f=3 is not allowed; allowed: an integer in [0, K/2) (K = 6 workers)"),
    ("heloco", hj.Syncer(quorum=4, aggregate=A.trimmed_mean(2)),
     "syncer.aggregate.f=2 is not allowed; allowed: an integer in [0, K/2) (K = 4 workers)"),
    ("diloco", hj.Syncer(aggregate=A.centered_clip(tau=0.0)), "syncer.aggregate.tau=0.0"),
    ("diloco", hj.Syncer(aggregate=A.norm_clip(-1.0)), "syncer.aggregate.bound=-1.0"),
    ("heloco", hj.Syncer(aggregate=A.median()), "median needs peers"),
    ("diloco", hj.Syncer(aggregate=A.screen()), "screen is for asynchronous arrivals"),
    ("ddp", hj.Syncer(aggregate=A.median()), "with DDP"),
    ("heloco", hj.Syncer(quorum=3, weights="tokens", aggregate=A.median()),
     "(median is not)"),
    ("heloco", hj.Syncer(aggregate=A.screen(cosine=2.0)), "syncer.aggregate.cosine=2.0"),
])
def test_bad_arguments_are_refused_in_one_line_naming_them(method, syncer, message):
  with pytest.raises(ValueError) as error:
    _run(method, False, syncer, steps=20)
  assert message in str(error.value) and "\n" not in str(error.value)


def test_the_cli_key_names_the_rule_and_its_refusals():
  import tiny  # pylint: disable=g-import-not-at-top
  from heloco_jax.cli.configs import validation  # pylint: disable=g-import-not-at-top
  from heloco_jax.lm import harness  # pylint: disable=g-import-not-at-top
  config = tiny.config("diloco", num_workers=5, **{"budget.tokens": 1600, "syncer.aggregate": "trimmed_mean(f=2)"})
  validation.validate(config)
  assert harness.syncer(config).aggregate == A.trimmed_mean(2)
  for value, message in (("trimmed_mean(f=3)", "syncer.aggregate.f=3 is not allowed"),
                         ("mode", "syncer.aggregate='mode' is not allowed")):
    config = tiny.config("diloco", num_workers=5, **{"budget.tokens": 1600, "syncer.aggregate": value})
    with pytest.raises(Exception, match=message.replace("(", r"\(").replace(")", r"\)")):
      validation.validate(config)
