"""Issue 57: a synchronous round's workers vmapped or one after another (the simulated
runtime's ``worker_batching``): the same training within float tolerance, one compiled inner
loop either way, and a one-line refusal of another value."""

import asyncio
import json

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cnn
import heloco_jax as hj

W = np.array([[1.0], [-2.0], [0.5]], np.float32)


def _loss(params, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ params["a"]) @ params["b"] - y) ** 2)


def _data(worker):
  rng = np.random.default_rng(worker)
  while True:
    x = rng.normal(worker, 1, (8, 3)).astype(np.float32)
    yield x, x @ W


PARAMS = {"a": jnp.full((3, 4), 0.1, jnp.float32), "b": jnp.full((4, 1), 0.1, jnp.float32)}


def _engine(batching, method="diloco"):
  inner_tx = (hj.palsgd_inner(optax.scale_by_adam(), 1e-2) if method == "palsgd"
              else optax.adam(1e-2))
  return hj.make_engine(_loss, PARAMS, [_data(i) for i in range(3)], method=method,
                        inner_tx=inner_tx, inner_steps=4, speeds="homogeneous",
                        budget=hj.Budget(steps=3 * 4 * 5), runtime=hj.simulated_runtime(
                            worker_batching=batching))


@pytest.mark.parametrize("method", ["diloco", "palsgd"])
def test_sequential_workers_train_as_the_vmapped_ones_with_one_compiled_loop(method):
  runs = {}
  for batching in ("vmap", "sequential"):
    engine = _engine(batching, method)
    asyncio.run(engine.run())
    inner = engine.runtime.executor.inner
    runs[batching] = (engine.rows, engine.params)
    warmup = method == "palsgd"  # PALSGD's DDP warm-up steps on the K batches together
    if batching == "sequential":  # one worker's program for every worker of every round
      assert inner.run_scan._cache_size() == 1 + warmup  # pylint: disable=protected-access
      assert inner.run_many_scan._cache_size() == 0  # pylint: disable=protected-access
    else:
      assert inner.run_many_scan._cache_size() == 1  # pylint: disable=protected-access
    engine.close()
  (rows_v, params_v), (rows_s, params_s) = runs["vmap"], runs["sequential"]
  assert [r["event"] for r in rows_v] == [r["event"] for r in rows_s]
  np.testing.assert_allclose([r.get("train_loss", 0.0) for r in rows_v],
                             [r.get("train_loss", 0.0) for r in rows_s], rtol=1e-4)
  for key in params_v:
    np.testing.assert_allclose(params_v[key], params_s[key], rtol=1e-4, atol=1e-6)


def test_another_worker_batching_is_refused_in_one_line():
  with pytest.raises(ValueError, match="worker_batching='pmap' is not allowed; allowed: 'auto'"):
    hj.simulated_runtime(worker_batching="pmap")


def test_auto_follows_the_measurement_per_backend():
  # benchmarks/worker_batching.py on CPU: one worker after another is at most 8% slower and up
  # to 3.8x faster (docs/DESIGN.md, "Worker batching"); accelerators keep vmap.
  from heloco_jax.runtime import simulated
  assert simulated.AUTO_BATCHING == {"cpu": "sequential", "gpu": "vmap", "tpu": "vmap"}
  engine = _engine("auto")
  try:
    platform = engine.runtime.executor.devices[0].platform
    assert engine.runtime.executor.batching == simulated.AUTO_BATCHING[platform]
  finally:
    engine.close()


def test_the_resolved_batching_is_in_the_runs_config(tmp_path):
  """Issue 79: "auto" is written to config.json as it ran (sequential on CPU), not as "auto"."""
  from heloco_jax.runtime import simulated
  hj.simulate(_loss, PARAMS, [_data(i) for i in range(3)], method="diloco", inner_steps=4,
              speeds="homogeneous", budget=hj.Budget(steps=3 * 4 * 2),
              runtime=hj.simulated_runtime(worker_batching="auto"), workdir=str(tmp_path))
  with open(tmp_path / "config.json") as f:
    recorded = json.load(f)
  import jax
  assert recorded["worker_batching"] == simulated.AUTO_BATCHING[jax.devices()[0].platform]
  if jax.devices()[0].platform == "cpu":
    assert recorded["worker_batching"] == "sequential"


@pytest.mark.parametrize("method", ["diloco", "palsgd"])
def test_vmap_and_sequential_agree_on_a_batchnorm_cnn(method):
  """Issue 79, item 2: tests/cnn.py's CNN (BatchNorm, Dropout), 4 rounds of H = 5 steps.
  Every parameter but the convolution's bias agrees within 1e-6 of its O(1) scale, the
  BatchNorm statistics within 1e-4 and the held-out loss within 1e-4 relative. The bias
  feeds a BatchNorm that subtracts it again: its gradient is 0 in exact arithmetic and
  float noise in practice, which Adam scales to full steps, so it differs by O(lr) between
  any two compilations, while the model's outputs do not (docs/DESIGN.md, "Worker
  batching")."""
  runs = {}
  for batching in ("vmap", "sequential"):
    runs[batching] = hj.simulate(cnn.cnn_loss, cnn.PARAMS, cnn.cnn_data(2), method=method,
                                 inner_steps=5, budget=hj.Budget(steps=2 * 5 * 4),
                                 model_state=cnn.STATS, eval_fn=cnn.cnn_eval,
                                 runtime=hj.simulated_runtime(worker_batching=batching))
  vmapped, sequential = runs["vmap"], runs["sequential"]
  assert vmapped.summary["outer_updates"] == sequential.summary["outer_updates"] >= 4
  for name in ("bn", "linear"):
    for leaf in vmapped.params[name]:
      np.testing.assert_allclose(vmapped.params[name][leaf], sequential.params[name][leaf],
                                 atol=1e-6, err_msg=f"{name}/{leaf}")
  np.testing.assert_allclose(vmapped.params["conv"]["kernel"],
                             sequential.params["conv"]["kernel"], atol=1e-6)
  assert np.max(np.abs(vmapped.params["conv"]["bias"] - sequential.params["conv"]["bias"])) < 1e-2
  for leaf in vmapped.model_state["bn"]:
    np.testing.assert_allclose(vmapped.model_state["bn"][leaf],
                               sequential.model_state["bn"][leaf], atol=1e-4)
  np.testing.assert_allclose(vmapped.summary["final_val_loss"],
                             sequential.summary["final_val_loss"], rtol=1e-4)
