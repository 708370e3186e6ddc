"""The public engine API: hj.simulate on a user's own model, loss, data and optimizers."""

import itertools
import os
import re
import runpy
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tiny

import heloco_jax as hj
from heloco_jax.runtime import base, simulated
from heloco_jax.training import methods

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
W_TRUE = np.array([[1.0], [-2.0], [0.5]], np.float32)


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.normal(0, 0.1, (3, 1)), jnp.float32), "b": jnp.zeros((1,))}


def _loss(params, batch):
  x, y = batch
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


class Stream:
  """A re-iterable, endless, non-IID stream of (x, y) batches for one worker."""

  def __init__(self, worker, n=16):
    self.worker, self.n = worker, n

  def __iter__(self):
    rng = np.random.default_rng(self.worker)
    while True:
      x = rng.normal(self.worker, 1.0, (self.n, 3)).astype(np.float32)
      yield x, x @ W_TRUE


X_VAL = np.random.default_rng(99).normal(1.0, 1.5, (64, 3)).astype(np.float32)


def _eval(params):
  return _loss(params, (X_VAL, X_VAL @ W_TRUE))


def _run(method="heloco", k=3, **kwargs):
  args = dict(inner_tx=optax.sgd(0.02), inner_steps=4, speeds=[1.0, 2.0, 3.0][:k],
              budget=hj.Budget(steps=120), eval_fn=_eval)
  args.update(kwargs)
  return hj.simulate(_loss, _params(), [Stream(i) for i in range(k)], method=method, **args)


def _close(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def _leaves_equal(a, b):
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b),
                                                   strict=True))


def test_the_readme_example_learns_and_is_bit_identical_across_runs(capsys):
  path = os.path.join(ROOT, "examples", "mlp_regression.py")
  first = runpy.run_path(path)["result"]
  second = runpy.run_path(path)["result"]
  assert first.summary["final_val_loss"] < 0.05 * first.summary["initial_val_loss"]
  assert _leaves_equal(first.params, second.params)
  assert first.history == second.history
  assert "->" in capsys.readouterr().out
  # The README shows the same example.
  with open(os.path.join(ROOT, "README.md")) as f:
    readme = f.read()
  with open(path) as f:
    code = f.read().split('"""', 2)[2].strip()
  assert code in readme


@pytest.mark.slow  # 9 runs, 16 s in CI: tests/test_docs.py runs the guide's own block (2 runs)
def test_the_guides_robust_aggregation_example_survives_its_faulty_worker(capsys):
  """examples/robust_aggregation.py (docs/GUIDE.md, "Robust aggregation and faulty workers"):
  per row, the robust rule ends near the clean run where mean() does not."""
  runpy.run_path(os.path.join(ROOT, "examples", "robust_aggregation.py"))
  rows = capsys.readouterr().out.strip().splitlines()
  assert len(rows) == 3 and "{'norm': " in rows[2]  # the screen rejected the ascending worker
  for row in rows:
    clean, poisoned, robust = (float(x) for x in re.findall(r"\d\.\de[-+]\d+", row))
    assert poisoned > 4 * clean and robust < 1.5 * clean, row
  with open(os.path.join(ROOT, "docs", "GUIDE.md")) as f:
    guide = f.read()
  with open(os.path.join(ROOT, "examples", "robust_aggregation.py")) as f:
    example = f.read()
  section = guide.split("### Robust aggregation and faulty workers", 1)[1]
  loss = section.split("def loss_fn(params, batch):", 1)[1].split("\n\n", 1)[0]
  assert "def loss_fn(params, batch):" + loss in example  # the guide shows the example's loss


@pytest.mark.parametrize("method", list(methods.METHODS))
def test_every_registry_method_runs_a_users_model_deterministically(method):
  inner_tx = None
  if method == "palsgd":
    inner_tx = hj.palsgd_inner(optax.identity(), 0.02, pseudo_sync_prob=0.2)
  result = _run(method, inner_tx=inner_tx or optax.sgd(0.02))
  again = _run(method, inner_tx=inner_tx or optax.sgd(0.02))
  assert _leaves_equal(result.params, again.params) and result.history == again.history
  assert jax.tree.structure(result.params) == jax.tree.structure(_params())
  summary = result.summary
  assert summary["method"] == method and summary["steps"] <= 120
  assert summary["final_val_loss"] < summary["initial_val_loss"]
  evals = [r for r in result.history if r["event"] == "eval"]
  assert evals[0]["steps"] == 0 and evals[-1]["steps"] == summary["steps"]
  if methods.METHODS[method].synchrony == "async":
    arrivals = [r for r in result.history if r["event"] == "arrival"]
    assert len(arrivals) == summary["outer_updates"] > 0
    assert all("staleness" in r and "sim_time" in r for r in arrivals)


def test_heloco_diagnostics_come_from_heloco_inside_a_users_chain():
  chain = optax.chain(optax.clip_by_global_norm(10.0), hj.heloco(0.7, 0.9, num_workers=3))
  result = _run(outer_tx=chain)
  arrivals = [r for r in result.history if r["event"] == "arrival"]
  assert arrivals and all("branch_count/keep" in r and "cosine_mean" in r for r in arrivals)
  # No HeLoCo in the chain: the cosine with the momentum, no HeLoCo fields.
  plain = _run("mla", outer_tx=optax.chain(optax.identity(), hj.mla(0.7, 0.9, num_workers=3)))
  arrival = [r for r in plain.history if r["event"] == "arrival"][-1]
  assert "cosine_mean" in arrival and "branch_count/keep" not in arrival


def test_an_outer_rule_in_optax_inject_hyperparams_runs_as_the_plain_rule():
  """optax.inject_hyperparams without static_args: the engine jits the rule's init, where K
  is a tracer (it once stayed in the state's static ρ, and the next run failed on it)."""
  def evals(result):
    return [r["val_loss"] for r in result.history if r["event"] == "eval"]
  plain = _run(outer_tx=hj.heloco(0.7, 0.9, num_workers=3))
  for _ in range(2):  # the second run meets the first one's compiled programs
    injected = _run(outer_tx=optax.inject_hyperparams(hj.heloco)(
        learning_rate=0.7, momentum=0.9, num_workers=3))
    # equal up to float32 rounding of 1 − μ (docs/ALGORITHMS.md, "Hyperparameters as arrays")
    np.testing.assert_allclose(evals(injected), evals(plain), rtol=1e-5)
    weights = [r["weight"] for r in injected.history if r["event"] == "arrival"]
    assert weights and weights == pytest.approx([1 / np.sqrt(3)] * len(weights))
  # CGAD's age gate (α, τ_c static data too) the same way
  injected = _run("cgad", outer_tx=optax.inject_hyperparams(hj.cgad)(
      learning_rate=0.01, decay=0.1, cutoff=8.0))
  np.testing.assert_allclose(evals(injected), evals(_run("cgad", outer_tx=hj.cgad(
      0.01, decay=0.1, cutoff=8.0))), rtol=1e-5)
  # η as a schedule of the outer updates: 0 from the 5th on, so θ stops there
  stopped = _run(outer_tx=optax.inject_hyperparams(hj.heloco)(
      learning_rate=optax.linear_schedule(0.7, 0.0, 5), num_workers=3),
      budget=hj.Budget(steps=120, eval_every_steps=24))
  rows = [r for r in stopped.history if r["event"] == "eval"]
  after = {r["val_loss"] for r in rows if r["outer_updates"] >= 5}
  assert len(rows) >= 5 and len(after) == 1 and rows[1]["val_loss"] != rows[0]["val_loss"]


def test_a_custom_outer_rule_changes_the_result():
  default = _run("mla")
  custom = _run("mla", outer_tx=hj.mla(0.3, 0.5, num_workers=3))
  assert not _leaves_equal(default.params, custom.params)


def test_a_run_whose_arrivals_are_all_rejected_stops_with_the_cause():
  with pytest.raises(hj.DivergenceError, match="non-finite .*inner learning rate"):
    _run(inner_tx=optax.sgd(1e6), budget=hj.Budget(steps=400))
  with pytest.raises(hj.DivergenceError, match="non-finite"):
    _run("diloco", inner_tx=optax.sgd(1e6), budget=hj.Budget(steps=400))


def test_a_non_finite_evaluation_stops_the_run():
  with pytest.raises(hj.DivergenceError, match="before training is not finite"):
    _run(eval_fn=lambda p: jnp.nan)


@pytest.mark.parametrize("kwargs, named", [
    (dict(method="nope"), "method='nope'"),
    (dict(budget=hj.Budget()), "at least one of steps, tokens or sim_seconds (a run needs an end)"),
    (dict(budget=None), "budget=None is not allowed"),
    (dict(inner_steps=0), "inner_steps=0"),
    (dict(speeds="warp"), "speeds"),
    (dict(speeds=[1.0, 2.0]), "speeds"),
    (dict(method="palsgd"), "hj.palsgd_inner"),
    (dict(method="diloco", method_options={"lookahead_dispatch": True}),
     "method_options key 'lookahead_dispatch' is not allowed with method='diloco'"),
    (dict(method="heloco", method_options={"lookahead_dispatch": False}),
     "method_options['lookahead_dispatch']=False is not allowed with method='heloco'"),
    (dict(method="ddp", reset_optimizer=True),
     "reset_optimizer=True is not allowed with method='ddp'"),
])
def test_bad_arguments_are_refused_in_one_line(kwargs, named):
  with pytest.raises(ValueError, match="allowed") as error:
    _run(**kwargs)
  assert named in str(error.value) and "\n" not in str(error.value)


def test_a_workdir_run_resumes_exactly(tmp_path):
  whole = _run("heloco", budget=hj.Budget(steps=200))
  rows = []

  def stop_after_some_rows(row):
    rows.append(row)
    if len(rows) == 25:
      raise KeyboardInterrupt
  with pytest.raises(KeyboardInterrupt):
    _run("heloco", budget=hj.Budget(steps=200),
         workdir=hj.Workdir(str(tmp_path), checkpoint_every=3), on_row=stop_after_some_rows)
  assert os.listdir(tmp_path / "checkpoints")
  resumed = _run("heloco", budget=hj.Budget(steps=200),
                 workdir=hj.Workdir(str(tmp_path), checkpoint_every=3))
  assert _leaves_equal(whole.params, resumed.params)
  with open(tmp_path / "metrics.jsonl") as f:
    assert len(f.readlines()) == len(whole.history)
  assert {k: v for k, v in resumed.summary.items() if "second" not in k} == {
      k: v for k, v in whole.summary.items() if "second" not in k}
  with pytest.raises(hj.WorkdirError, match="finished run"):
    _run("heloco", budget=hj.Budget(steps=200), workdir=str(tmp_path))


def test_server_does_the_bookkeeping_for_a_loop_of_your_own():
  params = _params()
  tx = hj.heloco(0.7, 0.9, num_workers=2)
  server = hj.Server(tx, params, lookahead=True)
  start0 = server.dispatch(worker=0)
  start1 = server.dispatch(worker=1)
  delta = jax.tree.map(lambda x: 0.1 * jnp.ones_like(x), params)
  row0 = server.arrive(delta, worker=0)
  assert row0["staleness"] == 0 and row0["applied"] and row0["version"] == 1
  row1 = server.arrive(delta, worker=1)  # dispatched at version 0, arrives at version 1
  assert row1["staleness"] == 1 and row1["version"] == 2 and "branch_count/keep" in row1
  # By hand: two HeLoCo updates with τ = 0 and 1.
  state, want = tx.init(params), params
  for tau in (0, 1):
    updates, state = tx.update(delta, state, want, staleness=tau)
    want = optax.apply_updates(want, updates)
  _close(server.params, want)  # eager by hand vs the server's jitted step: float rounding
  _close(server.dispatch(0), hj.lookahead_params(state, want))
  assert _leaves_equal(start0, params) and _leaves_equal(start1, params)  # m = 0 then
  bad = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), params)
  row = server.arrive(bad, worker=0)
  assert not row["applied"] and row["reason"] == "nan"
  _close(server.params, want)
  with pytest.raises(KeyError, match="not dispatched"):
    server.arrive(delta, worker=5)
  with pytest.raises(ValueError, match="lookahead"):
    hj.Server(optax.sgd(0.1), params, lookahead=True)


def test_palsgd_inner_with_p_zero_is_the_plain_step_and_pulls_toward_the_anchor():
  params, grads = _params(0), _params(1)
  anchor = jax.tree.map(lambda x: x + 1.0, params)
  plain = hj.scale_by_step_schedule(0.1)
  palsgd = hj.palsgd_inner(optax.identity(), 0.1, pseudo_sync_prob=0.0)
  want, _ = plain.update(grads, plain.init(params), params, step=0)
  got, state = palsgd.update(grads, palsgd.init(params), params, step=0, anchor=anchor,
                             uniform=0.5)
  assert _leaves_equal(got, want) and not bool(state.pseudo_sync)
  pull = hj.palsgd_inner(optax.identity(), 0.1, pseudo_sync_prob=0.5, pseudo_sync_rate=2.0)
  got, state = pull.update(grads, pull.init(params), params, step=0, anchor=anchor, uniform=0.1)
  assert bool(state.pseudo_sync)  # u = 0.1 < p: θ ← θ − (η_ps·α/p)(θ − θ̃) = θ − 0.4(θ − θ̃)
  for g, p, a in zip(jax.tree.leaves(got), jax.tree.leaves(params), jax.tree.leaves(anchor)):
    np.testing.assert_allclose(g, -0.4 * (np.asarray(p) - np.asarray(a)), rtol=1e-6)
  with pytest.raises(ValueError, match="convex"):
    hj.palsgd_inner(optax.identity(), 0.5, pseudo_sync_prob=0.1, pseudo_sync_rate=0.5)


def test_every_runtime_implements_the_protocol():
  engine = hj.make_engine(_loss, _params(), [Stream(0)], method="mla", inner_steps=4,
                          speeds=[1.0], budget=hj.Budget(steps=12))
  runtime = engine.runtime
  assert isinstance(runtime, base.Runtime)
  assert isinstance(runtime.executor, simulated.LocalExecutor)
  assert isinstance(runtime.executor, base.RoundExecutor)  # runs every synchrony
  assert runtime.executor.synchronies == base.SYNCHRONIES
  assert isinstance(engine.clock, simulated.SimulatedClock)
  from heloco_jax.runtime import devices, ray  # pylint: disable=g-import-not-at-top
  # The executors' classes define the protocol's methods (their attributes are set per run).
  for cls, protocol in ((simulated.LocalExecutor, base.RoundExecutor),
                        (devices.DeviceExecutor, base.RoundExecutor),
                        (ray.RayExecutor, base.Executor)):
    methods_ = {name for klass in protocol.__mro__ if klass.__module__ == base.__name__
                for name, value in vars(klass).items()
                if callable(value) and not name.startswith("_")}
    missing = [name for name in sorted(methods_) if not hasattr(cls, name)]
    assert methods_ and not missing, (cls, missing)
  assert ray.RayExecutor.synchronies == frozenset({"async"})


DEVICES_SCRIPT = """
import numpy as np, optax, jax, heloco_jax as hj, sys
sys.path.insert(0, {tests!r})
import test_api as t
for method in ("diloco", "mla"):
  result = hj.simulate(t._loss, t._params(), [t.Stream(i) for i in range(2)], method=method,
                       inner_tx=optax.sgd(0.02), inner_steps=4, budget=hj.Budget(steps=64),
                       eval_fn=t._eval, runtime=hj.devices_runtime(batch_size=16))
  print(method, result.summary["final_val_loss"] < result.summary["initial_val_loss"],
        result.summary["outer_updates"])
"""


RAY_SCRIPT = """
import heloco_jax as hj, sys
sys.path.insert(0, {tests!r})
import test_api as t
result = t._run("heloco", runtime=hj.ray_runtime(num_cpus=2), budget=hj.Budget(steps=48),
               speeds="mixed")  # the default: a real clock refuses simulated paces
print("heloco", result.summary["final_val_loss"] < result.summary["initial_val_loss"],
      result.summary["outer_updates"])
"""


# A local instance started for a run requires Ray's token (docs/DESIGN.md: its servers listen
# on every interface).
RAY_AUTH_SCRIPT = """
import heloco_jax as hj, optax, sys
sys.path.insert(0, {tests!r})
import test_api as t
from ray._private.authentication import authentication_utils
engine = hj.make_engine(t._loss, t._params(), [t.Stream(i) for i in range(2)], method="heloco",
                        inner_tx=optax.sgd(0.02), inner_steps=4, budget=hj.Budget(steps=8),
                        eval_fn=t._eval, runtime=hj.ray_runtime(num_cpus=2))
try:
  print("token", authentication_utils.is_token_auth_enabled())
finally:
  engine.close()
"""


def _script(script, env=None):
  """``script`` (this folder on its path) in a Python process of its own; its stdout lines."""
  out = subprocess.run([sys.executable, "-c", script.format(tests=os.path.dirname(__file__))],
                       env=env, capture_output=True, text=True, timeout=600, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout.split("\n")


def test_the_same_user_code_runs_on_real_devices():
  env = dict(os.environ, XLA_FLAGS=tiny.xla_flags(2),
             JAX_PLATFORMS="cpu")  # two host devices, also on a machine with one GPU
  lines = _script(DEVICES_SCRIPT, env)
  assert lines[0].startswith("diloco True") and lines[1].startswith("mla True"), lines


@pytest.mark.xdist_group("ray")  # with test_ray.py: one local Ray cluster at a time
@pytest.mark.slow  # 30–80 s: the default suite stays under 15 minutes
def test_the_same_user_code_runs_on_ray():
  """In a process of its own, as test_ray.py's runs (its ``_train`` says why)."""
  pytest.importorskip("ray")
  line = next(line for line in _script(RAY_SCRIPT) if line.startswith("heloco "))
  _, learned, updates = line.split()
  assert learned == "True" and int(updates) > 0, line


@pytest.mark.xdist_group("ray")
def test_a_local_ray_instance_requires_a_token_and_is_refused_without_one():
  pytest.importorskip("ray")
  env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
  assert "token True" in _script(RAY_AUTH_SCRIPT, env)
  out = subprocess.run(
      [sys.executable, "-c", RAY_AUTH_SCRIPT.format(tests=os.path.dirname(__file__))],
      env=dict(env, RAY_AUTH_MODE="disabled"), capture_output=True, text=True, timeout=600,
      check=False)
  assert out.returncode != 0 and "token" not in out.stdout
  assert ("refusing to start a local Ray instance with RAY_AUTH_MODE=disabled"
          in out.stderr.strip().splitlines()[-1])


def test_inside_an_event_loop_simulate_says_to_await_the_engine():
  import asyncio  # pylint: disable=g-import-not-at-top

  async def inside():
    _run()
  with pytest.raises(RuntimeError, match="await engine.run"):
    asyncio.run(inside())

  async def awaited():
    engine = hj.make_engine(_loss, _params(), [Stream(i) for i in range(3)], method="mla",
                            inner_tx=optax.sgd(0.02), inner_steps=4, speeds=[1.0, 2.0, 3.0],
                            budget=hj.Budget(steps=120), eval_fn=_eval)
    return await engine.run(), engine.params
  summary, params = asyncio.run(awaited())
  assert _leaves_equal(params, _run("mla").params) and summary["outer_updates"] > 0


def test_an_eval_dict_must_hold_the_loss():
  with pytest.raises(ValueError, match="'val_loss'"):
    _run(eval_fn=lambda p: {"mse": _eval(p)})
  result = _run(eval_fn=lambda p: {"val_loss": _eval(p), "mse": 2 * _eval(p)})
  assert {"val_loss", "mse"} <= set(result.history[0])


def test_a_workdir_holding_another_run_is_refused_naming_the_keys(tmp_path):
  def stop(row):
    if row["event"] == "arrival" and row["outer_updates"] == 4:
      raise KeyboardInterrupt
  with pytest.raises(KeyboardInterrupt):
    _run(workdir=hj.Workdir(str(tmp_path), checkpoint_every=2), on_row=stop)
  with pytest.raises(hj.WorkdirError, match=r"workdir=.* another config; differing keys: "
                                            r"seed \(0 -> 1\)\. Use a new workdir\."):
    _run(workdir=hj.Workdir(str(tmp_path), checkpoint_every=2), seed=1)


def test_a_requested_stop_ends_the_run_at_the_next_boundary():
  engine = hj.make_engine(_loss, _params(), [Stream(i) for i in range(3)], method="heloco",
                          inner_tx=optax.sgd(0.02), inner_steps=4, speeds=[1.0, 2.0, 3.0],
                          budget=hj.Budget(steps=120))
  import asyncio  # pylint: disable=g-import-not-at-top

  from heloco_jax.runtime import engine as engine_lib  # pylint: disable=g-import-not-at-top

  def stop_at_the_third(row):
    if row["event"] == "arrival" and row["outer_updates"] == 3:
      engine.request_stop("test")
  with pytest.raises(engine_lib.Stopped, match="stopped by test") as stop:
    asyncio.run(engine.run(stop_at_the_third, lambda e: None))
  assert stop.value.checkpointed and engine.version >= 3
  assert engine.version < _run("heloco", eval_fn=None).summary["outer_updates"]


def test_a_budget_below_one_dispatch_raises():
  with pytest.raises(hj.BudgetError, match="before any work reached the server.*4 steps"):
    _run(budget=hj.Budget(steps=3))


def _numpy_sgd_losses(batches, lr=0.02, steps=4):
  """SGD on ``_loss`` from ``_params()``, in NumPy: the loss of each step's batch."""
  params = {k: np.asarray(v, np.float64) for k, v in _params().items()}
  losses = []
  for x, y in batches[:steps]:
    residual = x @ params["w"] + params["b"] - y
    losses.append(np.mean(residual ** 2))
    params["w"] -= lr * 2 * x.T @ residual / len(x)
    params["b"] -= lr * 2 * residual.mean(axis=0)
  return losses


@pytest.mark.parametrize("method", ["heloco", "diloco", "ddp"])
def test_rows_report_the_mean_training_loss_of_the_steps_they_cover(method):
  result = _run(method, k=2, eval_fn=None)
  rows = [r for r in result.history if r["event"] in ("arrival", "train")]
  assert rows and all(r["event"] == ("arrival" if method == "heloco" else "train") for r in rows)
  first = [list(itertools.islice(Stream(i), 4)) for i in range(2)]  # the first 4 batches
  if method == "heloco":  # worker 0 (the faster) arrives first, from θ0
    want, steps = np.mean(_numpy_sgd_losses(first[0])), 4
  elif method == "diloco":  # both workers from θ0
    want, steps = np.mean(_numpy_sgd_losses(first[0]) + _numpy_sgd_losses(first[1])), 8
  else:  # one step on both workers' batches together
    together = [tuple(np.concatenate(parts) for parts in zip(a, b))
                for a, b in zip(first[0], first[1])]
    want, steps = np.mean(_numpy_sgd_losses(together)), 8
  assert rows[0]["steps"] == steps
  assert rows[0]["train_loss"] == pytest.approx(want, rel=1e-5)
  assert rows[-1]["train_loss"] < rows[0]["train_loss"]
