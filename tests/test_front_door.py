"""Issue 37: one front door (``hj.make_engine``), an engine without import circles, and no
silent trap for a user's code. Each trap test failed before the change."""

import asyncio
import inspect
import os
import pathlib
import re
import signal
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import heloco_jax as hj
from heloco_jax.training import inner as inner_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "heloco_jax"
W_TRUE = np.array([[1.0], [-2.0], [0.5]], np.float32)


def _params():
  return {"w": jnp.full((3, 1), 0.1, jnp.float32), "b": jnp.zeros((1,))}


def _loss(params, batch):
  x, y = batch
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


class Stream:
  """A re-iterable endless stream of (x, y) batches of one worker."""

  def __init__(self, worker, n=8, bad_at=None, bad_shape=(8, 4)):
    self.worker, self.n, self.bad_at, self.bad_shape = worker, n, bad_at, bad_shape

  def __iter__(self):
    rng = np.random.default_rng(self.worker)
    i = 0
    while True:
      shape = self.bad_shape if i == self.bad_at else (self.n, 3)
      x = rng.normal(self.worker, 1.0, shape).astype(np.float32)
      yield x, x[:, :3] @ W_TRUE
      i += 1


X_VAL = np.random.default_rng(9).normal(1.0, 1.0, (32, 3)).astype(np.float32)


def _eval(params):
  return _loss(params, (X_VAL, X_VAL @ W_TRUE))


def _data(k=3, **kwargs):
  return [Stream(i, **kwargs) for i in range(k)]


KW = dict(inner_tx=optax.sgd(0.02), inner_steps=4, speeds=[1.0, 2.0, 3.0],
          budget=hj.Budget(steps=96, eval_every_steps=24), eval_fn=_eval)


# ----------------------------------------------------------------- the package's shape

def test_runtimes_declare_capabilities_instead_of_stubs_and_nothing_outside_tests_their_kind():
  for path in (PACKAGE / "runtime").glob("*.py"):
    assert "NotImplementedError" not in path.read_text(), path
  kind = re.compile(r"""runtime\s*[!=]=\s*["']|\.runtime\s*[!=]=""")
  for path in PACKAGE.rglob("*.py"):
    if "runtime" not in path.relative_to(PACKAGE).parts[:1]:
      assert not kind.search(path.read_text()), path


def test_one_assembly_path():
  for path in list(PACKAGE.rglob("*.py")) + list((ROOT / "experiments").glob("*.py")):
    text = path.read_text()
    assert "harness.Simulation" not in text and "class Simulation" not in text, path
  assert "api.make_engine(" in (PACKAGE / "lm" / "harness.py").read_text()


# -------------------------------------------------------------------------- trap 1

def test_a_reset_keeps_the_step_count_of_a_users_optax_schedule():
  """A step schedule ending at step 3: after the first dispatch its rate is 0 for good."""
  schedule = optax.piecewise_constant_schedule(1.0, {3: 0.0})
  loop = inner_lib.InnerLoop(_loss, optax.sgd(schedule), reset_optimizer=True)
  batches = next(iter(Stream(0)))
  stacked = jax.tree.map(lambda x: np.stack([x] * 3), batches)
  first, _ = loop.run_jit(loop.start_jit(_params()), stacked, jax.random.key(0))
  again = loop.start(first.params, first)
  counts = [s.count for s in jax.tree.leaves(
      again.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
            if isinstance(s, optax.ScaleByScheduleState)]
  assert [int(c) for c in counts] == [3]
  second, _ = loop.run_jit(again, stacked, jax.random.key(1))
  for a, b in zip(jax.tree.leaves(second.params), jax.tree.leaves(first.params)):
    np.testing.assert_array_equal(a, b)  # the rate stays 0: no step moves θ any more


def test_a_reset_still_restarts_adams_moments():
  loop = inner_lib.InnerLoop(_loss, optax.adam(1e-2), reset_optimizer=True)
  stacked = jax.tree.map(lambda x: np.stack([x] * 2), next(iter(Stream(0))))
  first, _ = loop.run_jit(loop.start_jit(_params()), stacked, jax.random.key(0))
  again = loop.start(first.params, first)
  assert int(again.opt_state[0].count) == 0
  assert all(float(jnp.abs(x).sum()) == 0 for x in jax.tree.leaves(again.opt_state[0].mu))


# -------------------------------------------------------------------------- trap 2

def test_the_grace_window_combines_with_the_rules_own_rho():
  """ρ has one source, the rule: a user's hj.mla(weighting="polynomial") combines a grace
  window's arrivals with ρ = (1/√K)/√(1+τ), as method_options={"weighting": ...} does."""
  from heloco_jax.outer.weighting import arrival_weighting  # pylint: disable=g-import-not-at-top
  kw = {**KW, "speeds": [1.0, 1.0, 1.0], "syncer": hj.Syncer(grace_window=1.0), "jitter": 0.3}
  mine = hj.simulate(_loss, _params(), _data(), method="mla",
                     outer_tx=hj.mla(0.7, 0.9, num_workers=3, weighting="polynomial"), **kw)
  options = hj.simulate(_loss, _params(), _data(), method="mla",
                        method_options={"weighting": "polynomial"}, **kw)
  assert mine.history == options.history
  constant = hj.simulate(_loss, _params(), _data(), method="mla", **kw)
  assert constant.history != mine.history
  rho = arrival_weighting(hj.mla(0.7, 0.9, num_workers=4, weighting="polynomial").init(_params()))
  assert (rho(0), rho(3)) == (0.5, 0.25)


def test_a_rules_arrival_weighting_is_static_and_survives_jit_and_chains():
  from heloco_jax.outer.weighting import arrival_weighting  # pylint: disable=g-import-not-at-top
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   hj.heloco(0.7, 0.9, num_workers=4, weighting="polynomial"))
  state = jax.jit(tx.init)(_params())
  _, state = jax.jit(lambda s: tx.update(_params(), s, _params(), staleness=2))(state)
  assert arrival_weighting(state)(3) == 0.25
  assert len(jax.tree.leaves(state)) == len(jax.tree.leaves(tx.init(_params())))


# -------------------------------------------------------------------------- trap 3

def test_a_users_rule_without_an_arrival_weight_is_refused_for_an_asynchronous_method():
  with pytest.raises(ValueError, match=r"outer_tx holds no arrival weight ρ.*async_nesterov"):
    hj.make_engine(_loss, _params(), _data(), method="async_nesterov",
                   outer_tx=optax.sgd(0.7, 0.9, nesterov=True), budget=hj.Budget(steps=96))
  weighted = optax.chain(hj.scale_by_arrival_weight(num_workers=3),
                         optax.sgd(0.07, 0.9, nesterov=True))
  mine = hj.simulate(_loss, _params(), _data(), method="async_nesterov", outer_tx=weighted, **KW)
  method = hj.simulate(_loss, _params(), _data(), method="async_nesterov",
                       method_options={"learning_rate": 0.07}, **KW)
  assert mine.history == method.history  # the same rule, ρ = 1/√K included


def test_heloco_with_a_plain_optax_rule_is_refused_in_the_users_words():
  with pytest.raises(ValueError) as error:
    hj.make_engine(_loss, _params(), _data(), method="heloco",
                   outer_tx=optax.chain(hj.scale_by_arrival_weight(num_workers=3),
                                        optax.sgd(0.7)), budget=hj.Budget(steps=96))
  message = str(error.value)
  assert "method='heloco'" in message and "hj.heloco" in message and "look-ahead" in message
  assert "lookahead=" not in message and "lookahead_params" not in message


def test_method_options_typos_and_other_methods_keys_are_refused():
  with pytest.raises(ValueError, match="method_options key 'learning_rat' is not allowed with "
                                       "method='heloco'"):
    hj.make_engine(_loss, _params(), _data(), method_options={"learning_rat": 0.5},
                   budget=hj.Budget(steps=96))
  with pytest.raises(ValueError, match="'c' is not allowed .*dn_c"):
    hj.make_engine(_loss, _params(), _data(), method="delayed_nesterov",
                   method_options={"c": 0.4}, budget=hj.Budget(steps=96))


def test_an_outer_learning_rate_of_zero_is_refused_not_replaced_by_the_default():
  with pytest.raises(ValueError, match="learning_rate=0.0 is not allowed"):
    hj.make_engine(_loss, _params(), _data(), method="mla",
                   method_options={"learning_rate": 0.0}, budget=hj.Budget(steps=96))


# -------------------------------------------------------------------------- trap 4 and 6

def test_history_after_a_resume_is_the_whole_run_and_the_workdir_is_an_argument(tmp_path):
  clean = hj.simulate(_loss, _params(), _data(), **KW)
  engine = hj.make_engine(_loss, _params(), _data(),
                          workdir=hj.Workdir(str(tmp_path / "run"), checkpoint_every=3), **KW)
  arrivals = []

  def stop_after_seven(row):
    if row["event"] == "arrival":
      arrivals.append(row)
      if len(arrivals) == 7:
        engine.request_stop("test")
  with pytest.raises(hj.Stopped) as stopped:
    asyncio.run(engine.run(stop_after_seven))
  engine.close()
  assert stopped.value.checkpointed
  resumed = hj.simulate(_loss, _params(), _data(),
                        workdir=hj.Workdir(str(tmp_path / "run"), checkpoint_every=3), **KW)
  assert resumed.history == clean.history
  for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(clean.params)):
    np.testing.assert_array_equal(a, b)
  assert os.path.exists(tmp_path / "run" / "summary.json")


def test_simulate_stops_gracefully_on_sigterm_and_resumes(tmp_path):
  clean = hj.simulate(_loss, _params(), _data(), **KW)
  sent = []

  def terminate_once(row):
    if row["event"] == "arrival" and not sent:
      sent.append(row)
      os.kill(os.getpid(), signal.SIGTERM)
  with pytest.raises(hj.Stopped) as stopped:
    hj.simulate(_loss, _params(), _data(), workdir=str(tmp_path), on_row=terminate_once,
                handle_signals=True, **KW)
  assert stopped.value.reason == "SIGTERM" and stopped.value.checkpointed
  assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
  resumed = hj.simulate(_loss, _params(), _data(), workdir=str(tmp_path), **KW)
  assert resumed.history == clean.history


def test_a_misspelt_keyword_names_simulate():
  with pytest.raises(TypeError, match=r"simulate\(\) got an unexpected keyword argument "
                                      "'num_workers'"):
    hj.simulate(_loss, _params(), _data(), num_workers=4,  # type: ignore
                budget=hj.Budget(steps=96))


OPTIONS = ("method", "budget", "inner_steps", "speeds", "eval_fn", "seed", "outer_tx",
           "inner_tx", "method_options", "reset_optimizer", "syncer", "streaming", "compress",
           "membership", "comm", "jitter", "model_state", "model_state_merge", "runtime",
           "workdir", "deterministic", "rejection_limit", "metrics_fetch_every", "on_row",
           "handle_signals")
OLD_KEYWORDS = ("budget_steps", "budget_sim_seconds", "budget_tokens", "tokens_per_step",
                "eval_every_steps", "eval_every_tokens", "checkpoint_every", "outer_options",
                "lookahead_dispatch", "dylu", "palsgd_coins", "palsgd_warmup_steps",
                "grace_window", "fragments", "fragment_layout", "overlap_steps", "fragment_alpha")


def test_make_engine_declares_the_options_once_and_simulate_takes_the_same():
  engine = inspect.signature(hj.make_engine)
  assert len(engine.parameters) <= 28, list(engine.parameters)
  assert inspect.signature(hj.simulate).parameters == engine.parameters
  assert tuple(engine.parameters) == ("loss_fn", "params", "data") + OPTIONS
  assert all(engine.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY for name in OPTIONS)
  assert not set(OLD_KEYWORDS) & set(engine.parameters)  # no deprecated aliases


def test_an_old_keyword_is_refused_by_both_front_doors():
  for front_door in (hj.simulate, hj.make_engine):
    with pytest.raises(TypeError, match=r"budget_steps=, which was renamed: use "
                       r"budget=hj\.Budget\(steps=\.\.\.\)"):
      front_door(_loss, _params(), _data(), budget_steps=96)  # type: ignore


def test_a_run_needs_a_budget():
  # Required in the signature (pyright sees a missing one), and None refused in one line.
  with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'budget'"):
    hj.make_engine(_loss, _params(), _data())  # type: ignore[call-arg]
  with pytest.raises(ValueError, match=r"^budget=None is not allowed; allowed: "
                                       r"hj\.Budget\(steps=\.\.\.\)"):
    hj.make_engine(_loss, _params(), _data(), budget=None)  # type: ignore[arg-type]


def test_make_engines_on_row_and_handle_signals_are_the_runs_defaults(tmp_path):
  clean = hj.simulate(_loss, _params(), _data(), **KW)
  rows = []
  engine = hj.make_engine(_loss, _params(), _data(), on_row=rows.append, **KW)
  try:
    asyncio.run(engine.run())
  finally:
    engine.close()
  assert rows == clean.history == engine.rows

  def terminate_once(row):
    if row["event"] == "arrival" and not terminate_once.sent:
      terminate_once.sent = True
      os.kill(os.getpid(), signal.SIGTERM)
  terminate_once.sent = False
  engine = hj.make_engine(_loss, _params(), _data(), workdir=str(tmp_path), on_row=terminate_once,
                          handle_signals=True, **KW)
  try:
    with pytest.raises(hj.Stopped) as stopped:
      asyncio.run(engine.run())
  finally:
    engine.close()
  assert stopped.value.reason == "SIGTERM" and stopped.value.checkpointed
  assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored


# -------------------------------------------------------------------------- trap 5

def test_a_wrong_shaped_batch_names_the_worker_the_batch_and_the_leaf():
  data = _data()
  data[2] = Stream(2, bad_at=3)
  with pytest.raises(ValueError, match=r"worker 2's batch 3 has leaf '0' of shape \(8, 4\) "
                                       r"float32; allowed: the first batch's, \(8, 3\)"):
    hj.simulate(_loss, _params(), data, **KW)


def test_an_integer_params_leaf_is_named():
  params = {**_params(), "step": jnp.zeros((), jnp.int32)}
  with pytest.raises(ValueError, match="params leaf 'step' has dtype int32"):
    hj.make_engine(_loss, params, _data(), budget=hj.Budget(steps=96))


def test_a_vector_loss_names_loss_fn():
  with pytest.raises(ValueError, match=r"loss_fn returned shape \(8, 1\) float32 on worker 0's "
                                       "first batch; allowed: a scalar"):
    hj.make_engine(lambda p, b: (b[0] @ p["w"] - b[1]) ** 2, _params(), _data(),
                   budget=hj.Budget(steps=96))


def test_a_loss_fn_that_fails_to_trace_is_named_with_the_batch():
  with pytest.raises(ValueError, match=r"loss_fn\(params, batch\) fails on worker 0's first "
                                       r"batch \(0: \(8, 3\) float32, 1: \(8, 1\) float32\)"):
    hj.make_engine(lambda p, b: jnp.mean(b[0].T @ p["w"]), _params(), _data(),
                   budget=hj.Budget(steps=96))


def test_a_non_scalar_eval_fn_is_named():
  with pytest.raises(ValueError, match=r"eval_fn returned 'val_loss' of shape \(3,\)"):
    hj.simulate(_loss, _params(), _data(), **{**KW, "eval_fn": lambda p: jnp.ones(3)})


def test_data_that_runs_out_names_the_worker():
  data = _data()
  data[1] = [next(iter(Stream(1)))] * 5
  with pytest.raises(ValueError, match="worker 1's data ran out after 5 batches"):
    hj.simulate(_loss, _params(), data, **KW)


# -------------------------------------------------------------------------- trap 7

def test_the_notebook_and_its_readme_use_the_public_api():
  notebook = (ROOT / "notebooks" / "staleness_effects.py").read_text()
  readme = (ROOT / "notebooks" / "README.md").read_text()
  assert "hj.make_engine(" in notebook
  assert "scheduler.Simulation" not in readme and "make_engine" in readme


def test_design_md_lists_every_key_of_every_row_kind():
  design = (ROOT / "docs" / "DESIGN.md").read_text()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    rows = (hj.simulate(_loss, _params(), _data(), **KW).history
            + hj.simulate(_loss, _params(), _data(), method="diloco",
                          **{**KW, "budget": hj.Budget(steps=120, eval_every_steps=24)}).history
            + hj.simulate(_loss, _params(), _data(), method="mla", **KW).history)
  keys = {key for row in rows for key in row}
  missing = sorted(key for key in keys if f"`{key}`" not in design)
  assert not missing, missing
