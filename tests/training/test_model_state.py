"""Issue 57: model state (BatchNorm statistics), randomness and metrics of a user's model.

The merge rules are checked against a NumPy reference written from docs/DESIGN.md ("Model
state and randomness") on a toy whose state is a running mean of the batches; a flax.nnx CNN
with BatchNorm and Dropout trains through ``hj.simulate`` for heloco, diloco and ddp.
"""

import asyncio
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import cnn
import heloco_jax as hj
from heloco_jax.training import model_state as model_state_lib

H, K = 3, 2
W = np.array([[1.0], [-2.0]], np.float32)


def _batches(worker, n=60):
  rng = np.random.default_rng(worker)
  out = []
  for _ in range(n):
    x = rng.normal(worker, 1, (4, 2)).astype(np.float32)
    out.append((x, x @ W))
  return out


def _toy_loss(params, batch, *, state):
  """A linear model whose state is a running mean of its inputs (as BatchNorm's mean)."""
  x, y = batch
  new_state = {"mean": 0.9 * state["mean"] + 0.1 * jnp.mean(x, axis=0),
               "count": state["count"] + 1}
  loss = jnp.mean((x @ params["w"] - y) ** 2)
  return loss, (new_state, {"input_mean": jnp.mean(x)})


STATE0 = {"mean": np.zeros(2, np.float32), "count": np.zeros((), np.int32)}


# Steps between two syncs: H, or with 2 fragments (θ gets a second, unused leaf) H = 4 in 2 syncs.
SYNC_STEPS = {1: H, 2: 2}


def _simulate(method, fragments=1, **more):
  params = {"w": jnp.zeros((2, 1))}
  if fragments > 1:
    params["unused"] = jnp.zeros(3)
  return hj.simulate(_toy_loss, params, [_batches(0), _batches(1)],
                     method=method, inner_tx=optax.sgd(0.05),
                     inner_steps=SYNC_STEPS[fragments] * fragments, speeds=[1.0, 2.5],
                     budget=hj.Budget(steps=30), model_state=STATE0,
                     streaming=hj.Streaming(fragments=fragments), **more)


def _steps(state, batches):
  """The toy's state after ``batches`` (NumPy, float64)."""
  mean, count = np.array(state[0], np.float64), state[1]
  for x, _ in batches:
    mean = 0.9 * mean + 0.1 * np.asarray(x, np.float64).mean(axis=0)
    count += 1
  return mean, count


@pytest.mark.parametrize("merge, fragments", [("mean", 1), ("latest", 1), ("mean", 2)])
def test_asynchronous_arrivals_merge_the_state_as_documented(merge, fragments):
  """With fragments the model state travels with every fragment: a dispatch receives the
  server's copy, an arrival is merged into it (docs/DESIGN.md, "Model state and randomness")."""
  result = _simulate("heloco", fragments, model_state_merge=merge)
  arrivals = [row["worker"] for row in result.history if row["event"] == "arrival"]
  assert len(arrivals) >= 5 and set(arrivals) == {0, 1}
  if fragments > 1:
    assert {row["fragment"] for row in result.history if row["event"] == "arrival"} == {0, 1}
  data, steps = [_batches(0), _batches(1)], SYNC_STEPS[fragments]
  server = (np.zeros(2), 0)
  start, used = [server, server], [0, 0]
  for w in arrivals:  # each arrival: the worker's steps from the state it was sent
    end = _steps(start[w], data[w][used[w]:used[w] + steps])
    used[w] += steps
    server = (server[0] + (end[0] - server[0]) / K, end[1]) if merge == "mean" else end
    start[w] = server
  np.testing.assert_allclose(result.model_state["mean"], server[0], rtol=1e-5, atol=1e-6)
  assert int(result.model_state["count"]) == server[1]  # an integer leaf: the arriving one's


def _rounds_reference(result, steps):
  """The server's mean after the run's rounds (syncs) of ``steps`` steps each (NumPy)."""
  rounds = sum(row["event"] == "train" for row in result.history)
  data, server = [_batches(0), _batches(1)], (np.zeros(2), 0)
  for r in range(rounds):
    ends = [_steps(server, data[w][r * steps:(r + 1) * steps]) for w in range(K)]
    server = (np.mean([end[0] for end in ends], axis=0), ends[0][1])
  return server[0]


def test_streaming_rounds_average_the_workers_states_at_every_fragments_sync():
  result = _simulate("diloco", fragments=2)
  np.testing.assert_allclose(result.model_state["mean"], _rounds_reference(result, 2),
                             rtol=1e-5, atol=1e-6)


def test_rounds_average_the_workers_states_and_ddp_carries_its_one_state():
  result = _simulate("diloco")
  np.testing.assert_allclose(result.model_state["mean"], _rounds_reference(result, H),
                             rtol=1e-5, atol=1e-6)

  ddp = _simulate("ddp")
  steps = [row for row in ddp.history if row["event"] == "train"][-1]["steps"] // K
  data, state = [_batches(0), _batches(1)], (np.zeros(2), 0)
  for i in range(steps):  # one state over the workers' batches together
    x = np.concatenate([data[0][i][0], data[1][i][0]])
    state = _steps(state, [(x, None)])
  np.testing.assert_allclose(ddp.model_state["mean"], state[0], rtol=1e-5, atol=1e-6)
  assert int(ddp.model_state["count"]) == steps


def test_metrics_from_loss_fn_reach_the_rows_as_means_over_each_dispatch():
  result = _simulate("heloco")
  data, used = [_batches(0), _batches(1)], [0, 0]
  for row in (r for r in result.history if r["event"] == "arrival"):
    w = row["worker"]
    want = np.mean([x.mean() for x, _ in data[w][used[w]:used[w] + H]])
    used[w] += H
    assert row["train_input_mean"] == pytest.approx(want, rel=1e-5)


def _flagged(params, batch):
  """A plain loss_fn whose aux holds a boolean, a nested dict and a vector."""
  x, y = batch
  return jnp.mean((x @ params["w"] - y) ** 2), {
      "positive": jnp.mean(x) > 0, "stats": {"max": jnp.max(x)}, "first_column": x[:, 0]}


def test_boolean_and_nested_metrics_reach_the_rows_and_eval_rows_by_outer_inner_names():
  """A boolean's mean is the fraction of the dispatch's steps it held; a nested dict's
  scalars are named outer/inner (TensorBoard's groups); a vector is not a metric."""
  result = hj.simulate(_flagged, {"w": jnp.zeros((2, 1))}, [_batches(0), _batches(1)],
                       method="heloco", inner_tx=optax.sgd(0.05), inner_steps=H,
                       budget=hj.Budget(steps=30, eval_every_steps=12),
                       eval_fn=lambda p: {"val_loss": jnp.sum(p["w"] ** 2),
                                          "norms": {"w": jnp.linalg.norm(p["w"])}})
  data, used = [_batches(0), _batches(1)], [0, 0]
  arrivals = [r for r in result.history if r["event"] == "arrival"]
  for row in arrivals:
    w, seen = row["worker"], data[row["worker"]][used[row["worker"]]:used[row["worker"]] + H]
    used[w] += H
    assert row["train_positive"] == pytest.approx(np.mean([x.mean() > 0 for x, _ in seen]))
    assert row["train_stats/max"] == pytest.approx(np.mean([x.max() for x, _ in seen]),
                                                   rel=1e-6)
    assert "train_first_column" not in row
  assert {r["train_positive"] for r in arrivals} >= {0.0, 1.0}  # worker 0's and worker 1's
  evals = [r for r in result.history if r["event"] == "eval"]
  assert evals and all(r["norms/w"] == pytest.approx(np.sqrt(r["val_loss"]), rel=1e-5)
                       for r in evals)


def _state_loss_reporting_loss(params, batch, *, state):
  loss, (new_state, _) = _toy_loss(params, batch, state=state)
  return loss, (new_state, {"loss": loss})


@pytest.mark.parametrize("loss_fn, eval_fn, model_state, message", [
    (lambda p, b: (_flagged(p, b)[0], {"loss": _flagged(p, b)[0]}), None, None,
     r"loss_fn\(params, batch\)'s metrics hold 'loss', which would be written over train_loss"),
    (_state_loss_reporting_loss, None, STATE0, r"state=\.\.\.\)'s metrics hold 'loss'"),
    (_flagged, lambda p: {"val_loss": 0.0, "run": "a"}, None,
     r"eval_fn returned 'run' a str; allowed: real scalars only"),
    (_flagged, lambda p: {"val_loss": 0.0, "steps": 1.0}, None,
     r"eval_fn returned \['steps'\], the eval row's own keys \(event, steps, sim_time"),
])
def test_a_metric_named_loss_and_eval_values_not_scalars_or_named_as_the_row_are_refused(
    loss_fn, eval_fn, model_state, message):
  with pytest.raises(ValueError, match=message) as error:
    hj.simulate(loss_fn, {"w": jnp.zeros((2, 1))}, [_batches(0), _batches(1)],
                inner_steps=2, budget=hj.Budget(steps=8), eval_fn=eval_fn,
                model_state=model_state)
  assert "\n" not in str(error.value)


def _draws(params, batch, *, rng):
  x, y = batch
  return jnp.mean((x @ params["w"] - y) ** 2), {"draw": jax.random.uniform(rng)}


def test_every_step_of_every_worker_gets_its_own_key_and_a_replay_the_same():
  def run():
    return hj.simulate(_draws, {"w": jnp.zeros((2, 1))}, [_batches(0), _batches(1)],
                       method="heloco", inner_tx=optax.sgd(0.05), inner_steps=H,
                       speeds=[1.0, 2.5], budget=hj.Budget(steps=30), seed=7)
  first, second = run(), run()
  assert first.history == second.history
  rows = [row for row in first.history if row["event"] == "arrival"]
  steps = [0, 0]
  for row in rows:  # the documented keys: fold_in(k_w, s) at the worker's own step s
    w = row["worker"]
    base = jax.random.wrap_key_data(model_state_lib.worker_rng(7, w))
    want = np.mean([jax.random.uniform(jax.random.fold_in(base, s))
                    for s in range(steps[w], steps[w] + H)])
    steps[w] += H
    assert row["train_draw"] == pytest.approx(float(want), rel=1e-6)
  assert len({row["train_draw"] for row in rows}) == len(rows)


# A flax.nnx CNN with BatchNorm and Dropout: tests/cnn.py.
MODEL, GRAPHDEF, PARAMS, STATS, REST = cnn.MODEL, cnn.GRAPHDEF, cnn.PARAMS, cnn.STATS, cnn.REST
cnn_loss, cnn_eval, _cnn_data = cnn.cnn_loss, cnn.cnn_eval, cnn.cnn_data


@pytest.mark.parametrize("method, fragments", [("heloco", 1), ("diloco", 1), ("ddp", 1),
                                               ("heloco", 2)])
def test_a_flax_cnn_with_batchnorm_and_dropout_trains(method, fragments):
  result = hj.simulate(cnn_loss, PARAMS, _cnn_data(), method=method, inner_steps=4,
                       speeds=[1.0, 2.0], budget=hj.Budget(steps=96, eval_every_steps=48),
                       inner_tx=optax.adam(1e-2), eval_fn=cnn_eval, model_state=STATS,
                       method_options={"learning_rate": 0.7} if method != "ddp" else None,
                       streaming=hj.Streaming(fragments=fragments))
  evals = [row for row in result.history if row["event"] == "eval"]
  assert evals[-1]["accuracy"] > evals[0]["accuracy"] + 0.2, evals
  assert evals[-1]["val_loss"] < evals[0]["val_loss"]
  trained = [row for row in result.history if row["event"] in ("arrival", "train")]
  assert all(0 <= row["train_accuracy"] <= 1 for row in trained)
  # the statistics moved from BatchNorm's initial mean 0 / var 1
  stats = result.model_state["bn"]
  assert np.abs(stats["mean"].get_value()).max() > 0.1
  assert np.abs(stats["var"].get_value() - 1).max() > 0.1


def test_the_dropout_mask_is_new_every_step_and_the_same_on_a_replay():
  def loss_with_mask(params, batch, *, state, rng):
    loss, (new_state, metrics) = cnn_loss(params, batch, state=state, rng=rng)
    mask = nnx.Dropout(0.5)(jnp.ones(64), rngs=nnx.Rngs(default=rng))
    return loss, (new_state, {**metrics, "mask": jnp.sum(mask * jnp.arange(64.0))})

  def run():
    return hj.simulate(loss_with_mask, PARAMS, _cnn_data(), method="heloco", inner_steps=1,
                       speeds=[1.0, 2.0], budget=hj.Budget(steps=12), inner_tx=optax.adam(1e-2),
                       model_state=STATS)
  first = run()
  masks = [row["train_mask"] for row in first.history if row["event"] == "arrival"]
  assert len(masks) >= 8 and len(set(masks)) == len(masks)
  assert run().history == first.history


def test_a_killed_run_resumes_exactly_with_its_model_state(tmp_path):
  kwargs = dict(method="heloco", inner_steps=4, speeds=[1.0, 2.0],
                budget=hj.Budget(steps=96, eval_every_steps=24), inner_tx=optax.adam(1e-2),
                eval_fn=cnn_eval, model_state=STATS)
  workdir = hj.Workdir(str(tmp_path / "run"), checkpoint_every=3)
  whole = hj.simulate(cnn_loss, PARAMS, _cnn_data(), **kwargs)
  engine = hj.make_engine(cnn_loss, PARAMS, _cnn_data(), workdir=workdir, **kwargs)

  class Killed(Exception):
    pass

  def die(row):  # dies between checkpoints, as a SIGKILL would: nothing written at the end
    if row.get("outer_updates") == 10:
      raise Killed
  with pytest.raises(Killed):
    asyncio.run(engine.run(die))
  engine.close()
  resumed = hj.simulate(cnn_loss, PARAMS, _cnn_data(), workdir=workdir, **kwargs)
  assert resumed.history == whole.history
  for a, b in zip(jax.tree.leaves(resumed.model_state), jax.tree.leaves(whole.model_state)):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(whole.params)):
    np.testing.assert_array_equal(a, b)


def test_batchnorm_statistics_given_as_params_are_refused_naming_the_leaf():
  everything = nnx.state(MODEL, nnx.Any(nnx.Param, nnx.BatchStat))
  with pytest.raises(ValueError, match=r"params leaf 'bn/mean' is an nnx.BatchStat"):
    hj.simulate(lambda p, b: 0.0, everything, _cnn_data(), budget=hj.Budget(steps=8))


def _closes_over_the_module(params, batch):  # flax's idiom, the engine's key never used
  model = nnx.merge(GRAPHDEF, params, STATS, REST, copy=True)
  x, y = batch
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def _carries_batchnorm_but_takes_no_rng(params, batch, *, state):
  model = nnx.merge(GRAPHDEF, params, state, REST, copy=True)
  x, y = batch
  loss = optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
  return loss, (nnx.state(model, nnx.BatchStat), {})


@pytest.mark.parametrize("loss_fn, model_state", [
    (_closes_over_the_module, None),
    (_carries_batchnorm_but_takes_no_rng, STATS),  # the check once skipped a state loss_fn
])
def test_module_held_rngs_without_the_rng_keyword_are_refused(loss_fn, model_state):
  with pytest.raises(ValueError, match="draws random numbers from a key it holds"):
    hj.simulate(loss_fn, PARAMS, _cnn_data(), budget=hj.Budget(steps=8),
                model_state=model_state)


# The CNN built with a 'dropout' stream of its own: nnx.Dropout draws from it, not 'default'.
_STREAMS_GRAPHDEF, _STREAMS_PARAMS, _STREAMS_STATS, _STREAMS_REST = nnx.split(
    cnn.CNN(nnx.Rngs(params=0, dropout=1)), nnx.Param, nnx.BatchStat, ...)


def _reseeding(stream):
  def loss_fn(params, batch, *, state, rng):
    model = nnx.merge(_STREAMS_GRAPHDEF, params, state, _STREAMS_REST, copy=True)
    nnx.reseed(model, **{stream: rng})
    x, y = batch
    loss = optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
    return loss, (nnx.state(model, nnx.BatchStat), {})
  return loss_fn


def test_a_loss_fn_taking_rng_that_leaves_a_stream_unreseeded_is_refused():
  """Reseeding 'default' leaves the 'dropout' stream with its own key: one mask at every
  step of every worker, which the rng keyword does not cure. Reseeding 'dropout' is taken."""
  with pytest.raises(ValueError, match=r"takes rng but also draws random numbers from a key "
                                       r"it holds .*nnx.reseed\(model, dropout=rng\)"):
    hj.simulate(_reseeding("default"), _STREAMS_PARAMS, _cnn_data(), inner_steps=2,
                budget=hj.Budget(steps=8), model_state=_STREAMS_STATS)
  result = hj.simulate(_reseeding("dropout"), _STREAMS_PARAMS, _cnn_data(), inner_steps=2,
                       budget=hj.Budget(steps=8), model_state=_STREAMS_STATS)
  assert result.summary["steps"] == 8


_HELD = jax.random.key(7)


@pytest.mark.parametrize("draw, held", [
    (lambda x, r: jax.random.uniform(jax.random.split(r)[1], x.shape), False),
    (lambda x, r: jax.lax.cond(x.sum() > 0, lambda k: jax.random.uniform(k, x.shape),
                               lambda k: x, r), False),
    (lambda x, r: jax.lax.scan(lambda c, k: (c * jax.random.uniform(k, x.shape), None), x,
                               jax.random.split(r, 3))[0], False),
    (lambda x, r: jax.lax.fori_loop(0, 2, lambda i, c: c * jax.random.uniform(
        jax.random.fold_in(r, i), x.shape), x), False),
    (lambda x, r: jax.checkpoint(lambda k: jax.random.uniform(k, x.shape))(r), False),
    (lambda x, r: jax.random.uniform(_HELD, x.shape), True),
    (lambda x, r: jax.lax.cond(x.sum() > 0, lambda k: jax.random.uniform(_HELD, x.shape),
                               lambda k: x, r), True),
    (lambda x, r: jax.lax.scan(lambda c, k: (c * jax.random.uniform(_HELD, x.shape), None), x,
                               jax.random.split(r, 3))[0], True),
    (lambda x, r: jax.jit(lambda: jax.random.uniform(jax.random.key(0), x.shape))(), True),
])
def test_the_draws_are_traced_back_to_rng_through_calls_and_control_flow(draw, held):
  """checks.py follows the rng argument's data flow into cond, scan, while and remat: a draw
  from a key derived from it passes; one from any other key is refused."""
  def loss_fn(params, batch, *, rng):
    x, y = batch
    return jnp.mean((x * draw(x, rng) @ params["w"] - y) ** 2)
  run = functools.partial(hj.simulate, loss_fn, {"w": jnp.zeros((2, 1))},
                          [_batches(0), _batches(1)], inner_steps=2,
                          budget=hj.Budget(steps=4))
  if held:
    with pytest.raises(ValueError, match="draws random numbers from a key it holds"):
      run()
  else:
    assert run().summary["steps"] == 4


def test_keys_that_come_with_the_batches_are_not_held_keys():
  """A pipeline's per-batch keys (augmentation) differ at every step: a draw from them is
  taken, by a loss_fn with rng or without."""
  keyed = [[(x, y, np.asarray(jax.random.key_data(jax.random.key(100 * w + i))))
            for i, (x, y) in enumerate(_batches(w))] for w in range(2)]
  def noisy(params, batch):
    x, y, key = batch
    x = x + 0.1 * jax.random.normal(jax.random.wrap_key_data(key), x.shape)
    return jnp.mean((x @ params["w"] - y) ** 2)
  for loss_fn in (noisy, lambda params, batch, *, rng: noisy(params, batch)):
    result = hj.simulate(loss_fn, {"w": jnp.zeros((2, 1))}, keyed, inner_steps=2,
                         budget=hj.Budget(steps=4))
    assert result.summary["steps"] == 4


def test_a_model_state_holding_the_modules_rngs_is_refused():
  _, _, with_rngs = nnx.split(MODEL, nnx.Param, ...)
  with pytest.raises(ValueError, match=r"nnx.Rng(Key|Count).*allowed: a loss_fn that takes rng"):
    hj.simulate(cnn_loss, PARAMS, _cnn_data(), budget=hj.Budget(steps=8),
                model_state=with_rngs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(model_state=None), "takes the keyword state, but model_state is None"),
    (dict(model_state=STATE0, model_state_merge="median"), "model_state_merge='median'"),
])
def test_bad_model_state_arguments_are_one_line_errors(kwargs, message):
  with pytest.raises(ValueError, match=message):
    hj.simulate(_toy_loss, {"w": jnp.zeros((2, 1))}, [_batches(0), _batches(1)],
                inner_steps=2, budget=hj.Budget(steps=8), **kwargs)


def test_a_new_state_unlike_the_given_one_is_refused():
  def wrong(params, batch, *, state):
    loss, (new_state, metrics) = _toy_loss(params, batch, state=state)
    return loss, ({"mean": new_state["mean"][:1], "count": new_state["count"]}, metrics)
  with pytest.raises(ValueError, match="returned a new state .* unlike model_state"):
    hj.simulate(wrong, {"w": jnp.zeros((2, 1))}, [_batches(0), _batches(1)],
                budget=hj.Budget(steps=8), model_state=STATE0)
