"""The compiled inner loop: scan == step-by-step, schedule, reset, PALSGD, vmap, optax's extra
arguments."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import heloco_jax as hj
from heloco_jax.lm import model
from heloco_jax.training import inner

CONFIG = model.ModelConfig(d_model=32, num_layers=2, num_heads=4, context=16)
H, BATCH = 8, 4


def _setup(**inner_kwargs):
  """TinyGPT's loss with the default AdamW, or PALSGD's variant when p or η_ps is given."""
  graphdef, params = model.init(CONFIG, seed=0)
  kwargs = dict(learning_rate=3e-3, warmup_steps=3, total_steps=50)
  kwargs.update(inner_kwargs)
  reset = kwargs.pop("reset_optimizer", True)
  config = inner.InnerConfig(**kwargs)
  if "pseudo_sync_prob" in kwargs or "pseudo_sync_rate" in kwargs:
    tx = inner.palsgd_inner(inner.adamw_direction(config), config.schedule,
                            pseudo_sync_prob=config.pseudo_sync_prob,
                            pseudo_sync_rate=config.pseudo_sync_rate)
  else:
    tx = inner.adamw(config)
  loop = inner.InnerLoop(functools.partial(model.loss, graphdef), tx, reset)
  loop.graphdef, loop.schedule = graphdef, config.schedule
  return loop, params


def _batches(seed=0, h=H):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.integers(0, 256, (h, BATCH, CONFIG.context + 1)), jnp.int32)


def _close(a, b, rtol=1e-5, atol=1e-6):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def test_scanned_loop_equals_step_by_step_loop():
  loop, params = _setup()
  batches = _batches()
  scanned, metrics = loop.run_jit(loop.start(params), batches, jax.random.key(0))
  step = jax.jit(loop.step)
  state, losses = loop.start(params), []
  for batch in batches:
    state, loss, _ = step(state, batch)
    losses.append(float(loss))
  # Same float32 ops in a different compiled program: agreement to ~1e-6 of
  # parameter scale after 8 AdamW steps (a wrong step would move ~lr = 3e-3).
  _close(scanned.params, state.params, rtol=1e-4, atol=2e-6)
  np.testing.assert_allclose(metrics.loss, losses, rtol=1e-5)
  assert int(scanned.step) == H


def test_schedule_follows_the_workers_own_step_count_across_dispatches():
  loop, params = _setup()
  state, first = loop.run_jit(loop.start(params), _batches(0), jax.random.key(0))
  state, second = loop.run_jit(loop.start(state.params, state), _batches(1), jax.random.key(0))
  np.testing.assert_array_equal(np.concatenate([first.step, second.step]), np.arange(2 * H))
  want = [float(loop.schedule(t)) for t in range(2 * H)]
  assert want[0] == 0.0 and want[3] == pytest.approx(3e-3)  # warm-up, then peak
  assert int(state.step) == 2 * H


@pytest.mark.parametrize("reset", [True, False])
def test_optimizer_reset_at_dispatch_is_an_option(reset):
  loop, params = _setup(reset_optimizer=reset)
  state, _ = loop.run_jit(loop.start(params), _batches(), jax.random.key(0))
  restarted = loop.start(state.params, state)
  mu = restarted.opt_state[0][1].mu  # ((clip, adam, decay), schedule)
  moved = max(float(jnp.abs(x).max()) for x in jax.tree.leaves(mu))
  assert (moved == 0.0) == reset
  assert int(restarted.step) == H


@pytest.mark.parametrize("start", ["start", "start_jit"])
def test_start_copies_so_the_callers_params_survive_donation(start):
  loop, params = _setup()
  loop.run_jit(getattr(loop, start)(params), _batches(), jax.random.key(0))
  assert float(jnp.sum(params["head"]["bias"])) == 0.0  # still readable


@pytest.mark.parametrize("reset", [True, False])
def test_compiled_start_equals_the_eager_one(reset):
  loop, params = _setup(reset_optimizer=reset)
  first = loop.start(params)
  np.testing.assert_equal(jax.device_get(loop.start_jit(params)), jax.device_get(first))
  state, _ = loop.run_jit(first, _batches(), jax.random.key(0))
  np.testing.assert_equal(jax.device_get(loop.start_jit(state.params, state)),
                          jax.device_get(loop.start(state.params, state)))


def test_palsgd_with_p_zero_equals_the_plain_loop():
  loop, params = _setup(pseudo_sync_prob=0.0)
  anchor = jax.tree.map(lambda x: x + 1.0, params)  # a pull would be visible
  plain, plain_metrics = loop.run_jit(loop.start(params), _batches(), jax.random.key(0))
  palsgd, palsgd_metrics = loop.run_jit(loop.start(params), _batches(), jax.random.key(0), anchor)
  assert not bool(palsgd_metrics.pseudo_sync.any())
  _close(palsgd.params, plain.params, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(palsgd_metrics.loss, plain_metrics.loss, rtol=1e-6)


def test_palsgd_pseudo_sync_pull_matches_the_spec():
  """Replays the run in float64 from the spec: coin → pull toward θ̃, else AdamW at α/(1−p)."""
  p, rate = 0.4, 0.5
  loop, params = _setup(pseudo_sync_prob=p, pseudo_sync_rate=rate, learning_rate=2e-3)
  anchor = jax.tree.map(lambda x: x + 0.05, params)
  key = jax.random.key(7)
  batches = _batches(2, h=12)
  final, metrics = loop.run_jit(loop.start(params), batches, key, anchor)
  coins = np.asarray(jax.random.uniform(key, (12,)) < p)
  np.testing.assert_array_equal(metrics.pseudo_sync, coins)
  assert 0 < coins.sum() < 12  # both kinds of step occur
  # The reference: the plain AdamW loop, stepped at α/(1 − p) where the coin says so.
  config = inner.InnerConfig(learning_rate=2e-3, warmup_steps=3, total_steps=50)
  plain = inner.InnerLoop(loop.loss_fn, inner.adamw(config))
  step = jax.jit(plain.step)
  state = plain.start(params)
  for t, (coin, batch) in enumerate(zip(coins, batches)):
    if coin:
      pull = rate * float(loop.schedule(t)) / p
      new = jax.tree.map(lambda x, a: np.asarray(x, np.float64)
                         - pull * (np.asarray(x, np.float64) - np.asarray(a, np.float64)),
                         state.params, anchor)
      state = inner.InnerState(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), new),
                               state.opt_state, state.step + 1)
      assert float(metrics.loss[t]) == 0.0
    else:
      state, _, _ = step(state, batch, lr_scale=1.0 / (1.0 - p))
  _close(final.params, state.params, rtol=1e-4, atol=2e-6)
  _close(final.opt_state.inner, state.opt_state[0], rtol=1e-4, atol=1e-8)


def test_vmapped_workers_equal_separate_runs():
  loop, params = _setup()
  params_b = model.init(CONFIG, seed=1)[1]
  stack = lambda *xs: jnp.stack(xs)
  states = jax.tree.map(stack, loop.start(params), loop.start(params_b))
  batches = jnp.stack([_batches(0), _batches(1)])
  keys = jax.random.split(jax.random.key(0), 2)
  together, _ = loop.run_many(states, batches, keys, None)
  for w, p in enumerate([params, params_b]):
    alone, _ = loop.run_jit(loop.start(p), batches[w], keys[w])
    _close(jax.tree.map(lambda x: x[w], together.params), alone.params, rtol=1e-4, atol=2e-6)


def test_loss_falls_on_a_repeating_pattern():
  loop, params = _setup(learning_rate=1e-2, total_steps=200)
  pattern = np.tile(np.arange(CONFIG.context + 1) % 5 + 97, (30, BATCH, 1)).astype(np.int32)
  _, metrics = loop.run_jit(loop.start(params), jnp.asarray(pattern), jax.random.key(0))
  assert float(metrics.loss[-1]) < 0.2 * float(metrics.loss[0])


@pytest.mark.parametrize("kwargs, named", [
    (dict(learning_rate=0.0), "inner.learning_rate=0.0"),
    (dict(warmup_steps=-1), "inner.warmup_steps=-1"),
    (dict(warmup_steps=10, total_steps=10), "inner.total_steps=10"),
    (dict(min_learning_rate_ratio=1.5), "inner.min_learning_rate_ratio=1.5"),
    (dict(weight_decay=-0.1), "inner.weight_decay=-0.1"),
    (dict(b2=1.0), "inner.b2=1.0"),
    (dict(grad_clip=-1.0), "inner.grad_clip=-1.0"),
    (dict(pseudo_sync_prob=1.0), "inner.pseudo_sync_prob=1.0"),
    (dict(pseudo_sync_rate=-0.5), "inner.pseudo_sync_rate=-0.5"),
    (dict(learning_rate=0.5, pseudo_sync_prob=0.1, pseudo_sync_rate=0.5),
     "inner.pseudo_sync_rate=0.5"),
])
def test_invalid_inner_config(kwargs, named):
  with pytest.raises(ValueError, match="allowed:") as error:
    inner.InnerConfig(**kwargs).check_pseudo_sync()  # PALSGD's pull: checked for PALSGD only
  assert named in str(error.value)


def test_loss_falls_on_synthetic_data_end_to_end():
  """Synthetic languages → grain iterator → scanned inner loop → held-out loss falls."""
  from heloco_jax.lm import data, evaluate  # pylint: disable=g-import-not-at-top
  ds = data.make_data(source="synthetic", partition="non_iid", num_workers=2,
                      context=CONFIG.context, batch_size=BATCH, val_sequences_per_language=8,
                      max_bytes_per_language=60_000)
  loop, params = _setup(learning_rate=1e-2, warmup_steps=5, total_steps=400)
  evaluator = evaluate.Evaluator(functools.partial(model.token_losses, loop.graphdef),
                                 ds.validation_tokens,
                                 ds.validation_language_ids, ds.languages)
  before = evaluator.as_metrics(params)
  iterator = ds.worker_iterator(0)  # worker 0 reads only ds.languages[0]
  state = loop.start(params)
  for _ in range(4):
    batches = jnp.asarray(np.stack([next(iterator) for _ in range(25)]))
    state, metrics = loop.run_jit(state, batches, jax.random.key(0))
  after = evaluator.as_metrics(state.params)
  own = f"val_loss/{ds.languages[0]}"
  assert after[own] < 0.6 * before[own], (before, after)  # learns its own language
  assert float(metrics.loss[-5:].mean()) < 0.6 * before[own]


def test_train_loss_is_the_mean_over_the_steps_that_read_a_batch():
  metrics = inner.InnerMetrics(loss=jnp.array([[1.0, 0.0, 3.0], [2.0, 2.0, 0.0]]),
                               pseudo_sync=jnp.array([[False, True, False], [False, False, True]]),
                               step=jnp.zeros((2, 3), jnp.int32))
  assert float(inner.train_loss(metrics)) == pytest.approx(2.0)  # (1 + 3 + 2 + 2) / 4
  assert float(inner.train_loss(metrics._replace(pseudo_sync=jnp.ones((2, 3), bool)))) == 0.0


def _regression(params, batch):
  x, y = batch
  return jnp.mean((x @ params["w"] - y) ** 2)


def test_the_step_gives_optax_its_value_grad_and_value_fn():
  """optax's extra arguments of a step (README's optax chains): Polyak's step size reads the
  loss (``value``); checked against NumPy, f = mean((Xw − y)²), g = 2Xᵀ(Xw − y)/n,
  w ← w − min(η_max, f / (‖g‖² + ε))·g."""
  rng = np.random.default_rng(0)
  x, w = rng.normal(size=(8, 3)), rng.normal(size=(3, 1))
  y = x @ np.array([[1.0], [-2.0], [0.5]])
  loop = inner.InnerLoop(_regression, optax.polyak_sgd(max_learning_rate=10.0, eps=1e-6))
  state, loss, _ = jax.jit(loop.step)(loop.start({"w": jnp.asarray(w, jnp.float32)}),
                                      (jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)))
  r = x @ w - y
  f, g = np.mean(r ** 2), 2 * x.T @ r / len(x)
  want = w - min(10.0, f / (np.sum(g ** 2) + 1e-6)) * g
  assert float(loss) == pytest.approx(f, rel=1e-5)
  np.testing.assert_allclose(np.asarray(state.params["w"]), want, rtol=1e-4, atol=1e-5)


def test_optax_lbfgs_and_reduce_on_plateau_run_as_inner_optimizers():
  """L-BFGS's line search calls ``value_fn`` (the loss on the step's batch); reduce_on_plateau
  reads ``value``. Both once failed inside the inner loop for want of them."""
  def stream(worker):
    data = np.random.default_rng(worker)
    while True:
      x = data.normal(size=(16, 3)).astype(np.float32)
      yield x, x @ np.array([[1.0], [-2.0], [0.5]], np.float32)
  for tx, below in [(optax.lbfgs(), 1e-3),
                    (optax.chain(optax.adam(0.05), optax.contrib.reduce_on_plateau()), 0.05)]:
    result = hj.simulate(_regression, {"w": jnp.zeros((3, 1))}, [stream(0), stream(1)],
                         inner_tx=tx, inner_steps=4, budget=hj.Budget(steps=80))
    x, y = next(stream(9))
    assert float(_regression(result.params, (x, y))) < below  # about 5.25 at w = 0


def _loop_as(loop, mode):
  """``loop``'s loss and optimizer with the inner loop ``mode`` ("scan" or "steps")."""
  other = inner.InnerLoop(loop.loss_fn, loop.tx, loop.reset_optimizer, loop=mode)
  other.schedule = loop.schedule
  return other


@pytest.mark.parametrize("palsgd", [False, True])
def test_the_loop_of_compiled_steps_equals_the_scan(palsgd):
  """docs/DESIGN.md, "The inner loop": H compiled steps from Python run the scan's body with
  the scan's coins; the same math in another program (float agreement, identical coins)."""
  loop, params = _setup(**(dict(pseudo_sync_prob=0.4) if palsgd else {}))
  anchor = jax.tree.map(lambda x: x + 0.05, params) if palsgd else None
  key = jax.random.key(3)
  runs = {mode: _loop_as(loop, mode).run_jit(loop.start(params), _batches(), key, anchor)
          for mode in ("scan", "steps")}
  (scanned, m_scan), (stepped, m_steps) = runs["scan"], runs["steps"]
  _close(stepped.params, scanned.params, rtol=1e-4, atol=2e-6)
  np.testing.assert_array_equal(m_steps.pseudo_sync, m_scan.pseudo_sync)
  np.testing.assert_array_equal(m_steps.step, np.arange(H))
  np.testing.assert_allclose(m_steps.loss, m_scan.loss, rtol=1e-5)
  assert int(stepped.step) == H and bool(m_scan.pseudo_sync.any()) == palsgd


def test_the_loop_of_compiled_steps_vmaps_workers_as_the_scan():
  loop, params = _setup(pseudo_sync_prob=0.4)
  anchor = jax.tree.map(lambda x: x + 0.05, params)
  stack = lambda *xs: jnp.stack(xs)
  batches = jnp.stack([_batches(0), _batches(1)])
  keys = jax.random.split(jax.random.key(0), 2)
  runs = {}
  for mode in ("scan", "steps"):
    other = _loop_as(loop, mode)
    runs[mode] = other.run_many(jax.tree.map(stack, other.start(params), other.start(params)),
                                batches, keys, anchor)
  (scanned, m_scan), (stepped, m_steps) = runs["scan"], runs["steps"]
  assert m_steps.loss.shape == m_scan.loss.shape == (2, H)
  np.testing.assert_array_equal(m_steps.pseudo_sync, m_scan.pseudo_sync)
  _close(stepped.params, scanned.params, rtol=1e-4, atol=2e-6)


def test_the_loop_of_compiled_steps_replays_bit_for_bit():
  loop, params = _setup()
  stepped = _loop_as(loop, "steps")
  first, _ = stepped.run_jit(loop.start(params), _batches(), jax.random.key(0))
  again, _ = _loop_as(loop, "steps").run_jit(loop.start(params), _batches(), jax.random.key(0))
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _conv_loss(params, batch):
  x, y = batch
  out = jax.lax.conv_general_dilated(x, params["k"], (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
  return jnp.mean((out.mean(axis=(1, 2, 3)) - y) ** 2)


def test_auto_runs_compiled_steps_for_a_convolution_on_cpu_and_the_scan_else():
  """XLA:CPU runs a convolution inside a rolled while loop several times slower than alone
  (``python -m benchmarks.users_model``); everything else keeps the scan and its bits."""
  assert inner.auto_loop("cpu", True) == "steps"
  assert [inner.auto_loop(p, c) for p, c in [("cpu", False), ("gpu", True), ("tpu", True)]] == [
      "scan"] * 3
  conv = inner.InnerLoop(_conv_loss, optax.adam(1e-2))
  params = {"k": jnp.full((3, 3, 1, 2), 0.1)}
  batches = (jnp.ones((3, 2, 5, 5, 1)), jnp.ones((3, 2)))
  state, metrics = conv.run_jit(conv.start(params), batches, jax.random.key(0))
  assert conv.loop_for(state, None) == inner.auto_loop(jax.default_backend(), True)
  assert metrics.loss.shape == (3,) and int(state.step) == 3
  loop, gpt_params = _setup()
  loop.run_jit(loop.start(gpt_params), _batches(), jax.random.key(0))
  assert loop.loop_for(None, None) == "scan"  # no convolution: the scan on every platform
  assert loop.run_scan._cache_size() == 1  # pylint: disable=protected-access


def test_another_loop_is_refused_in_one_line():
  with pytest.raises(ValueError, match="loop='unrolled' is not allowed; allowed: 'auto'"):
    inner.InnerLoop(_conv_loss, loop="unrolled")


def test_a_user_chooses_the_loop_through_the_simulated_runtime():
  """``hj.simulated_runtime(inner_loop=...)``: "scan" keeps the bits of the releases before
  "auto" for a convolution on CPU, "steps" agrees with it to float reassociation, and another
  value is refused in one line naming the argument."""
  def stream():
    rng = np.random.default_rng(0)
    while True:
      yield (rng.normal(0, 1, (2, 5, 5, 1)).astype(np.float32),
             rng.normal(0, 1, (2,)).astype(np.float32))
  params = {"k": jnp.full((3, 3, 1, 2), 0.1)}
  def run(loop):
    return hj.simulate(_conv_loss, params, [stream(), stream()], method="diloco", inner_steps=3,
                       inner_tx=optax.sgd(0.05), budget=hj.Budget(steps=6),
                       runtime=hj.simulated_runtime(inner_loop=loop)).params["k"]
  scanned, stepped = run("scan"), run("steps")
  np.testing.assert_allclose(scanned, stepped, rtol=1e-5, atol=1e-7)
  assert not np.array_equal(scanned, params["k"])  # it trained
  np.testing.assert_array_equal(run("auto"), run(inner.auto_loop(jax.default_backend(), True)))
  with pytest.raises(ValueError, match="^inner_loop='unrolled' is not allowed; allowed: 'auto'"):
    hj.simulated_runtime(inner_loop="unrolled")
