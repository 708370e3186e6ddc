"""Identities, properties, compatibility and validation of heloco_jax.outer.

The line-by-line comparison with an independent NumPy implementation of
ALGORITHMS.md lives in test_outer_reference.py; this file checks the
identities the spec lists, the geometric properties of the correction
(hypothesis), jit / vmap / bfloat16 / no host sync, optax composition and
every construction-time error.
"""

from __future__ import annotations

import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import heloco_jax as hj
from heloco_jax.outer import correction as correction_lib

# float32 has a unit roundoff of 6e-8; the quantities below are sums over at
# most a few hundred elements and ≤ 40 chained updates, so 1e-5 relative is
# a comfortable bound for "the same math done in a different order", while
# any real rule difference (a missing μ, a wrong sign) shows up at ≥ 1e-2.
RTOL, ATOL = 1e-5, 1e-6


def _tree(rng, scale=1.0):
  return {
      "dense": {"kernel": jnp.asarray(rng.normal(size=(6, 5)) * scale, jnp.float32),
                "bias": jnp.asarray(rng.normal(size=(5,)) * scale, jnp.float32)},
      "embed": jnp.asarray(rng.normal(size=(3, 2, 4)) * scale, jnp.float32),
  }


def _assert_tree_close(a, b, rtol=RTOL, atol=ATOL):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64),
                               rtol=rtol, atol=atol)


def _run(tx, params, arrivals, staleness):
  """Applies the arrivals in order; returns the params and state after each."""
  state = tx.init(params)
  update = jax.jit(tx.update)
  history = []
  for delta, tau in zip(arrivals, staleness):
    updates, state = update(delta, state, params, staleness=tau)
    params = optax.apply_updates(params, updates)
    history.append((params, state))
  return history


def _arrivals(seed, n=32):
  rng = np.random.default_rng(seed)
  drift = _tree(rng, 0.5)  # a common direction, so momentum builds up and aligns
  arrivals = [jax.tree.map(lambda d, x: d + x, drift, _tree(rng, rng.uniform(0.2, 2.0)))
              for _ in range(n)]
  staleness = [int(t) for t in rng.integers(0, 6, size=n)]
  return _tree(rng), arrivals, staleness


# ---------------------------------------------------------------- identities


@pytest.mark.parametrize("c", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("weighting", ["constant", "polynomial", "none"])
def test_delayed_nesterov_with_buffer_one_is_async_nesterov(c, weighting):
  params, arrivals, staleness = _arrivals(0)
  dn = _run(hj.delayed_nesterov(0.07, 0.9, buffer_size=1, c=c, num_workers=4,
                                weighting=weighting), params, arrivals, staleness)
  nesterov = _run(hj.async_nesterov(0.07, 0.9, num_workers=4, weighting=weighting),
                  params, arrivals, staleness)
  for (p_dn, s_dn), (p_n, s_n) in zip(dn, nesterov):
    _assert_tree_close(p_dn, p_n)
    _assert_tree_close(s_dn.momentum, s_n[1][0].trace)  # chain: (ρ, sgd=(trace, lr))


def test_delayed_nesterov_buffers_between_refreshes():
  """Momentum only moves every N-th arrival; the buffer empties then."""
  params, arrivals, staleness = _arrivals(1, n=7)
  history = _run(hj.delayed_nesterov(0.1, 0.9, buffer_size=3, c=0.2), params, arrivals, staleness)
  moments = [s.momentum["embed"] for _, s in history]
  np.testing.assert_array_equal(moments[0], 0.0)
  np.testing.assert_array_equal(moments[1], 0.0)
  assert np.abs(moments[2]).max() > 0
  np.testing.assert_array_equal(moments[3], moments[2])
  np.testing.assert_array_equal(history[2][1].buffer["embed"], 0.0)
  assert np.abs(history[3][1].buffer["embed"]).max() > 0


def _quadratic_async_run(tx, *, num_workers=3, arrivals=40, seed=0):
  """A toy asynchronous run whose pseudo-gradients depend on the dispatch point.

  Worker i minimises |θ − target_i|² with 5 SGD steps from its start point;
  it is dispatched from ``lookahead_params`` (look-ahead dispatch) and
  arrives after the others in a fixed round-robin order, so every arrival
  after the first few is stale by num_workers − 1.
  """
  rng = np.random.default_rng(seed)
  params = _tree(rng)
  targets = [_tree(rng) for _ in range(num_workers)]
  state = tx.init(params)
  update = jax.jit(tx.update)
  version = 0
  in_flight = [(hj.lookahead_params(state, params), version) for _ in range(num_workers)]
  trajectory = []
  for t in range(arrivals):
    worker = t % num_workers
    start, dispatched_at = in_flight[worker]
    end = start
    for _ in range(5):
      end = jax.tree.map(lambda x, y: x - 0.1 * (x - y), end, targets[worker])
    delta = jax.tree.map(jnp.subtract, start, end)
    updates, state = update(delta, state, params, staleness=version - dispatched_at)
    params = optax.apply_updates(params, updates)
    version += 1
    in_flight[worker] = (hj.lookahead_params(state, params), version)
    trajectory.append((params, state.momentum, in_flight[worker][0]))
  return trajectory


@pytest.mark.parametrize("schedule, bad", [("normalized", -2.0), ("eq14", -0.2)])
def test_heloco_that_never_corrects_is_mla_with_lookahead_dispatch(schedule, bad):
  kwargs = dict(num_workers=3, weighting="polynomial")
  heloco = _quadratic_async_run(hj.heloco(0.7, 0.9, keep_threshold=-1.0, bad_threshold=bad,
                                          rotate_schedule=schedule, **kwargs))
  mla = _quadratic_async_run(hj.mla(0.7, 0.9, **kwargs))
  for got, want in zip(heloco, mla):
    _assert_tree_close(got, want)


def test_default_heloco_differs_from_mla_on_the_same_run():
  """Guards the identity above against being vacuous: the correction acts."""
  heloco = _quadratic_async_run(hj.heloco(0.7, 0.9, num_workers=3))
  mla = _quadratic_async_run(hj.mla(0.7, 0.9, num_workers=3))
  gap = max(float(jnp.abs(a - b).max()) for a, b in
            zip(jax.tree.leaves(heloco[-1][0]), jax.tree.leaves(mla[-1][0])))
  assert gap > 1e-3


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("scope", ["leaf", "tree"])
def test_first_heloco_update_equals_mla(order, scope):
  params, arrivals, _ = _arrivals(2)
  heloco = hj.heloco(num_workers=5, weighting="polynomial", weight_order=order, scope=scope)
  mla = hj.mla(num_workers=5, weighting="polynomial")
  u_h, s_h = heloco.update(arrivals[0], heloco.init(params), params, staleness=3)
  u_m, s_m = mla.update(arrivals[0], mla.init(params), params, staleness=3)
  _assert_tree_close(u_h, u_m, rtol=0, atol=0)
  _assert_tree_close(s_h.momentum, s_m.momentum, rtol=0, atol=0)
  assert int(s_h.info.branch_counts[correction_lib.PASS]) == len(jax.tree.leaves(params)) or (
      scope == "tree" and int(s_h.info.branch_counts[correction_lib.PASS]) == 1)


@pytest.mark.parametrize("make", [hj.mla, hj.heloco])
def test_lookahead_params_is_theta_minus_eta_mu_m(make):
  params, arrivals, staleness = _arrivals(3, n=5)
  tx = make(0.6, 0.85, num_workers=2)
  params_t, state = _run(tx, params, arrivals, staleness)[-1]
  want = jax.tree.map(lambda p, m: np.asarray(p, np.float64) - 0.6 * 0.85 * np.asarray(m, np.float64),
                      params_t, state.momentum)
  _assert_tree_close(hj.lookahead_params(state, params_t), want)
  # Equals θ while m = 0.
  _assert_tree_close(hj.lookahead_params(tx.init(params), params), params, rtol=0, atol=0)


def test_lookahead_params_inside_a_chain_and_errors():
  params, arrivals, _ = _arrivals(4, n=2)
  tx = optax.chain(optax.clip_by_global_norm(100.0), hj.heloco(0.5, 0.9))
  state = tx.init(params)
  _, state = tx.update(arrivals[0], state, params, staleness=0)
  inner = state[1]
  _assert_tree_close(hj.lookahead_params(state, params), hj.lookahead_params(inner, params),
                     rtol=0, atol=0)
  with pytest.raises(ValueError, match="lookahead_params.*0 MLAState or HeLoCoState"):
    hj.lookahead_params(hj.async_nesterov().init(params), params)
  both = (hj.mla().init(params), hj.heloco().init(params))
  with pytest.raises(ValueError, match="holds 2"):
    hj.lookahead_params(both, params)
  # The order before optax's (params, state) is named in the message.
  with pytest.raises(ValueError, match=r"lookahead_params: the arguments are \(state, params\)"):
    hj.lookahead_params(params, state)


def test_the_servers_readers_find_the_sub_state_when_traced_and_equal_the_eager_readers():
  from heloco_jax.outer import lookahead  # pylint: disable=g-import-not-at-top
  from heloco_jax.training import server as server_lib  # pylint: disable=g-import-not-at-top
  params, arrivals, _ = _arrivals(21, n=2)
  tx = optax.chain(optax.clip_by_global_norm(100.0),
                   optax.inject_hyperparams(hj.heloco)(learning_rate=0.5, num_workers=2))
  state = tx.init(params)
  for delta in arrivals:  # the heloco state sits at chain index 1, in inject's inner_state
    _, state = tx.update(delta, state, params, staleness=0)
    row = jax.device_get(server_lib._heloco_row(state))
    eager = jax.device_get(hj.heloco_diagnostics(state, per_block=False))
    assert row.keys() == eager.keys() - {"staleness"}
    for name, value in row.items():
      np.testing.assert_array_equal(value, eager[name], err_msg=name)
    scaled = lookahead.scaled_momentum(lookahead.find_state(state, (hj.HeLoCoState,), "test"))
    for ours, theirs in zip(jax.tree.leaves(server_lib._scaled_momentum(state)),
                            jax.tree.leaves(scaled)):
      np.testing.assert_array_equal(ours, theirs)
  with pytest.raises(ValueError, match="outer_momentum: .* holds 0"):
    server_lib._alignment(optax.sgd(0.1).init(params), params)


def test_weight_orders_agree_when_weight_is_one():
  params, arrivals, staleness = _arrivals(5)
  before = _run(hj.heloco(weight_order="before"), params, arrivals, staleness)
  after = _run(hj.heloco(weight_order="after"), params, arrivals, staleness)
  _assert_tree_close(before[-1][0], after[-1][0])


def test_weight_orders_differ_only_through_confidence():
  """With κ = 0, conf = |d|/(|d|+ε) ≈ 1 in both orders, so they agree for ρ ≠ 1."""
  params, arrivals, staleness = _arrivals(6)
  kw = dict(num_workers=4, weighting="polynomial", confidence_scale=0.0)
  before = _run(hj.heloco(weight_order="before", **kw), params, arrivals, staleness)
  after = _run(hj.heloco(weight_order="after", **kw), params, arrivals, staleness)
  _assert_tree_close(before[-1][0], after[-1][0], rtol=1e-4)
  differ_before = _run(hj.heloco(weight_order="before", num_workers=4), params, arrivals, staleness)
  differ_after = _run(hj.heloco(weight_order="after", num_workers=4), params, arrivals, staleness)
  gap = max(float(jnp.abs(a - b).max()) for a, b in
            zip(jax.tree.leaves(differ_before[-1][0]), jax.tree.leaves(differ_after[-1][0])))
  assert gap > 1e-4


def test_tree_scope_equals_leaf_scope_on_a_single_leaf():
  rng = np.random.default_rng(7)
  d, m = jnp.asarray(rng.normal(size=50), jnp.float32), jnp.asarray(rng.normal(size=50), jnp.float32)
  leaf, info_leaf = hj.heloco_correct(d, m, scope="leaf")
  tree, info_tree = hj.heloco_correct(d, m, scope="tree")
  np.testing.assert_allclose(leaf, tree, rtol=RTOL, atol=ATOL)
  assert int(info_leaf.branch[0]) == int(info_tree.branch[0])


def test_tree_scope_uses_one_cosine_for_the_whole_tree():
  m = {"a": jnp.ones(4), "b": jnp.ones(4)}
  d = {"a": jnp.ones(4), "b": -0.5 * jnp.ones(4)}  # leaf cosines 1 and −1; tree cosine 1/√5·...
  _, info_leaf = hj.heloco_correct(d, m, scope="leaf")
  _, info_tree = hj.heloco_correct(d, m, scope="tree")
  assert hj.block_names(d) == ["a", "b"] and hj.block_names(d, "tree") == ["tree"]
  np.testing.assert_array_equal(info_leaf.branch, [correction_lib.KEEP, correction_lib.SHRINK])
  want = (4 - 2) / (math.sqrt(4 + 1) * math.sqrt(8))
  assert info_tree.cosine.shape == (1,)
  np.testing.assert_allclose(float(info_tree.cosine[0]), want, rtol=1e-6)
  assert int(info_tree.branch[0]) == correction_lib.KEEP
  np.testing.assert_array_equal(info_tree.branch_counts, [0, 1, 0, 0])


# ---------------------------------------------------------------- properties


def _pair_with_cosine(seed, dim, cosine, d_norm, m_norm):
  """A pair (d, m) with the given cosine and norms, in float32."""
  rng = np.random.default_rng(seed)
  m_dir = rng.normal(size=dim)
  m_dir /= np.linalg.norm(m_dir)
  ortho = rng.normal(size=dim)
  ortho -= ortho @ m_dir * m_dir
  ortho /= np.linalg.norm(ortho)
  d = d_norm * (cosine * m_dir + math.sqrt(max(1 - cosine ** 2, 0.0)) * ortho)
  return jnp.asarray(d, jnp.float32), jnp.asarray(m_norm * m_dir, jnp.float32)


def _cos(x, y):
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))


_norms = st.floats(1e-3, 1e3)
_settings = hypothesis.settings(max_examples=60, deadline=None, derandomize=True)


@_settings
@hypothesis.given(seed=st.integers(0, 2**31), dim=st.integers(2, 64),
                  cosine=st.floats(0.0, 0.199), d_norm=_norms, m_norm=_norms,
                  schedule=st.sampled_from(["normalized", "eq14"]),
                  strength=st.floats(0.0, 5.0))
def test_rotate_keeps_the_norm_and_raises_the_cosine(seed, dim, cosine, d_norm, m_norm,
                                                     schedule, strength):
  d, m = _pair_with_cosine(seed, dim, cosine, d_norm, m_norm)
  hypothesis.assume(1e-5 <= _cos(d, m) < 0.2 - 1e-5)  # away from the branch edges
  d_hat, info = hj.heloco_correct(d, m, rotate_schedule=schedule, rotate_strength=strength)
  assert int(info.branch[0]) == correction_lib.ROTATE
  np.testing.assert_allclose(np.linalg.norm(np.asarray(d_hat, np.float64)),
                             np.linalg.norm(np.asarray(d, np.float64)), rtol=2e-5)
  assert _cos(d_hat, m) >= _cos(d, m) - 1e-5
  assert 0.0 <= float(info.rotation[0]) <= 1.0


@_settings
@hypothesis.given(seed=st.integers(0, 2**31), dim=st.integers(2, 64),
                  cosine=st.floats(-1.0, -1e-3), d_norm=_norms, m_norm=_norms,
                  strength=st.floats(0.0, 5.0), cap=st.floats(0.0, 1.0))
def test_shrink_lowers_the_norm_and_raises_the_cosine(seed, dim, cosine, d_norm, m_norm,
                                                      strength, cap):
  d, m = _pair_with_cosine(seed, dim, cosine, d_norm, m_norm)
  hypothesis.assume(_cos(d, m) < -1e-5)
  d_hat, info = hj.heloco_correct(d, m, shrink_strength=strength, max_shrink=cap)
  assert int(info.branch[0]) == correction_lib.SHRINK
  assert np.linalg.norm(np.asarray(d_hat, np.float64)) <= (
      np.linalg.norm(np.asarray(d, np.float64)) * (1 + 1e-6))
  assert _cos(d_hat, m) >= _cos(d, m) - 1e-5
  assert 0.0 <= float(info.shrinkage[0]) <= cap + 1e-7


@_settings
@hypothesis.given(seed=st.integers(0, 2**31), cosine=st.floats(0.2, 1.0), d_norm=_norms,
                  m_norm=_norms)
def test_keep_and_pass_leave_the_update_alone(seed, cosine, d_norm, m_norm):
  d, m = _pair_with_cosine(seed, 16, cosine, d_norm, m_norm)
  hypothesis.assume(_cos(d, m) >= 0.2 + 1e-5)  # away from the branch edge
  d_hat, info = hj.heloco_correct(d, m)
  np.testing.assert_array_equal(d_hat, d)
  assert int(info.branch[0]) == correction_lib.KEEP
  assert float(info.relative_correction[0]) == 0.0
  d_hat, info = hj.heloco_correct(d, jnp.zeros_like(m))
  np.testing.assert_array_equal(d_hat, d)
  assert int(info.branch[0]) == correction_lib.PASS


# ------------------------------------------------------ jit, vmap, dtypes


_FACTORIES = {
    "heloco": lambda: hj.heloco(num_workers=4, weighting="polynomial"),
    "heloco_tree_after_eq14": lambda: hj.heloco(num_workers=4, scope="tree", weight_order="after",
                                                rotate_schedule="eq14"),
    "mla": lambda: hj.mla(num_workers=4, weighting="polynomial"),
    "async_nesterov": lambda: hj.async_nesterov(num_workers=4, weighting="polynomial"),
    "delayed_nesterov": lambda: hj.delayed_nesterov(0.1, buffer_size=3, c=0.2, num_workers=4,
                                                    weighting="polynomial"),
}


@pytest.mark.parametrize("name", sorted(_FACTORIES))
def test_jit_matches_eager(name):
  params, arrivals, staleness = _arrivals(8, n=6)
  tx = _FACTORIES[name]()
  eager_state, jit_state = tx.init(params), tx.init(params)
  jitted = jax.jit(tx.update)
  for delta, tau in zip(arrivals, staleness):
    eager_updates, eager_state = tx.update(delta, eager_state, params, staleness=tau)
    jit_updates, jit_state = jitted(delta, jit_state, params, staleness=jnp.int32(tau))
    _assert_tree_close(eager_updates, jit_updates)
  _assert_tree_close(eager_state, jit_state)


@pytest.mark.parametrize("name", sorted(_FACTORIES))
def test_vmap_over_a_leading_replica_axis(name):
  """Three independent replicas batched with vmap equal three separate runs."""
  tx = _FACTORIES[name]()
  runs = [_arrivals(10 + r, n=5) for r in range(3)]
  stack = lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
  params = stack([r[0] for r in runs])
  state = jax.vmap(tx.init)(params)
  update = jax.jit(jax.vmap(tx.update))
  for t in range(5):
    deltas = stack([r[1][t] for r in runs])
    taus = jnp.asarray([r[2][t] for r in runs], jnp.int32)
    updates, state = update(deltas, state, params, staleness=taus)
    params = optax.apply_updates(params, updates)
  for r, (p0, arrivals, staleness) in enumerate(runs):
    single = _run(tx, p0, arrivals, staleness)[-1][0]
    _assert_tree_close(jax.tree.map(lambda x: x[r], params), single)


@pytest.mark.parametrize("name", sorted(_FACTORIES))
def test_bfloat16_params_keep_float32_momentum(name):
  params, arrivals, staleness = _arrivals(12, n=8)
  bf16 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.bfloat16), tree)
  tx = _FACTORIES[name]()
  history = _run(tx, bf16(params), [bf16(a) for a in arrivals], staleness)
  final_params, final_state = history[-1]
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(final_params))
  float_leaves = [x for x in jax.tree.leaves(final_state) if jnp.issubdtype(x.dtype, jnp.floating)]
  assert float_leaves and all(x.dtype == jnp.float32 for x in float_leaves)
  # Same run in float32 from the same (bf16-rounded) inputs: bfloat16 keeps 8
  # bits of mantissa (2^-8 ≈ 0.4% per rounding of θ), so agree to ~2%.
  reference = _run(tx, jax.tree.map(lambda x: x.astype(jnp.float32), bf16(params)),
                   [jax.tree.map(lambda x: x.astype(jnp.float32), bf16(a)) for a in arrivals],
                   staleness)[-1][0]
  _assert_tree_close(final_params, reference, rtol=2e-2, atol=2e-2)


_ACCUMULATING = {
    "heloco": lambda dtype: hj.heloco(num_workers=4, accumulator_dtype=dtype),
    "mla": lambda dtype: hj.mla(num_workers=4, accumulator_dtype=dtype),
    "async_nesterov": lambda dtype: hj.async_nesterov(num_workers=4, accumulator_dtype=dtype),
    "delayed_nesterov": lambda dtype: hj.delayed_nesterov(0.1, buffer_size=2, c=0.2,
                                                          num_workers=4,
                                                          accumulator_dtype=dtype),
}


def _accumulators(state):
  """The momentum (and DN's buffer) trees inside a rule's state."""
  momentum = hj.outer_momentum(state)
  return [momentum, state.buffer] if isinstance(state, hj.DelayedNesterovState) else [momentum]


@pytest.mark.parametrize("name", sorted(_ACCUMULATING))
def test_accumulator_dtype_sets_the_momentum_dtype_and_keeps_it(name):
  params, arrivals, staleness = _arrivals(19, n=4)
  default = _run(_ACCUMULATING[name](None), params, arrivals, staleness)
  explicit = _run(_ACCUMULATING[name](jnp.float32), params, arrivals, staleness)
  half = _run(_ACCUMULATING[name](jnp.bfloat16), params, arrivals, staleness)
  for (p_d, s_d), (p_f, s_f), (p_h, s_h) in zip(default, explicit, half):
    # None is float32 (unlike optax.trace's None), bit for bit the same as jnp.float32.
    assert all(x.dtype == jnp.float32 for tree in _accumulators(s_d) for x in jax.tree.leaves(tree))
    for a, b in zip(jax.tree.leaves((p_d, s_d)), jax.tree.leaves((p_f, s_f))):
      np.testing.assert_array_equal(a, b)
    # bfloat16: every accumulator stays bfloat16 after each update (one jitted program),
    # θ keeps its own dtype, and the run stays within bfloat16 rounding of the float32 one.
    assert all(x.dtype == jnp.bfloat16 for tree in _accumulators(s_h) for x in jax.tree.leaves(tree))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(p_h))
  _assert_tree_close(half[-1][0], default[-1][0], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("factory", [hj.heloco, hj.mla, hj.async_nesterov, hj.delayed_nesterov])
def test_accumulator_dtype_must_be_a_floating_dtype(factory):
  kwargs = dict(learning_rate=0.1, buffer_size=2) if factory is hj.delayed_nesterov else {}
  for bad, named in ((jnp.int32, "accumulator_dtype=<class 'jax.numpy.int32'>"),
                     ("int8", "accumulator_dtype='int8'"),
                     # what optax.inject_hyperparams passes for a dtype not in static_args
                     (jnp.asarray(1.0), "accumulator_dtype=Array(1.")):
    with pytest.raises(ValueError) as error:
      factory(accumulator_dtype=bad, **kwargs)
    message = str(error.value)
    assert message.startswith(f"{factory.__name__}: {named}") and "allowed:" in message, message


@pytest.mark.parametrize("name", ["heloco", "mla", "delayed_nesterov"])
def test_the_arrival_count_saturates_instead_of_wrapping_around(name):
  params, arrivals, staleness = _arrivals(20, n=1)
  tx = _ACCUMULATING[name](None)
  top = jnp.iinfo(jnp.int32).max
  state = tx.init(params)._replace(count=jnp.asarray(top - 1, jnp.int32))
  for _ in range(2):
    _, state = jax.jit(tx.update)(arrivals[0], state, params, staleness=staleness[0])
  assert state.count.dtype == jnp.int32 and int(state.count) == top


def test_string_options_are_literal_types_listing_the_allowed_values():
  """A type checker sees the same choices the construction-time checks allow."""
  import importlib  # pylint: disable=g-import-not-at-top
  import typing  # pylint: disable=g-import-not-at-top
  correction, heloco, weighting = (importlib.import_module(f"heloco_jax.outer.{name}")
                                   for name in ("correction", "heloco", "weighting"))
  hints = typing.get_type_hints(hj.heloco)
  for option, allowed in (("weighting", weighting.WEIGHTINGS),
                          ("rotate_schedule", correction.ROTATE_SCHEDULES),
                          ("weight_order", heloco.WEIGHT_ORDERS), ("scope", correction.SCOPES)):
    assert typing.get_origin(hints[option]) is typing.Literal
    assert typing.get_args(hints[option]) == allowed
  for factory in (hj.mla, hj.async_nesterov, hj.delayed_nesterov, hj.arrival_weight,
                  hj.scale_by_arrival_weight):
    assert typing.get_args(typing.get_type_hints(factory)["weighting"]) == weighting.WEIGHTINGS
  correct_hints = typing.get_type_hints(hj.heloco_correct)
  assert typing.get_args(correct_hints["scope"]) == correction.SCOPES


@pytest.mark.parametrize("name", sorted(_FACTORIES))
def test_state_and_params_can_be_donated(name):
  """A server donates θ and the outer state; no two state leaves may alias."""
  params, arrivals, staleness = _arrivals(18, n=3)
  tx = _FACTORIES[name]()

  def step(params, state, delta, tau):
    updates, state = tx.update(delta, state, params, staleness=tau)
    return optax.apply_updates(params, updates), state

  donated = jax.jit(step, donate_argnums=(0, 1))
  p, s = jax.tree.map(jnp.copy, params), tx.init(params)
  for delta, tau in zip(arrivals, staleness):
    p, s = donated(p, s, delta, jnp.int32(tau))
  _assert_tree_close(p, _run(tx, params, arrivals, staleness)[-1][0])


def _primitive_names(jaxpr):
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      names |= _primitive_names(sub)
  return names


@pytest.mark.parametrize("name", sorted(_FACTORIES))
def test_arrival_path_never_syncs_to_the_host(name):
  """update + apply + look-ahead + diagnostics trace as one jitted program.

  Any host sync (float(), bool(), np.asarray of a value) raises while
  tracing, and the program holds no host callback. (jax's transfer guard
  cannot show this on CPU, where device→host is zero-copy and unguarded.)
  """
  params, arrivals, staleness = _arrivals(13, n=1)
  tx = _FACTORIES[name]()
  is_heloco = name.startswith("heloco")

  def arrival(params, state, delta, tau):
    updates, state = tx.update(delta, state, params, staleness=tau)
    params = optax.apply_updates(params, updates)
    extras = (hj.lookahead_params(state, params), hj.heloco_diagnostics(state)) if is_heloco else ()
    return params, state, extras

  jaxpr = jax.make_jaxpr(arrival)(params, tx.init(params), arrivals[0], jnp.int32(staleness[0]))
  names = _primitive_names(jaxpr.jaxpr)
  assert not {n for n in names if "callback" in n or n in ("infeed", "outfeed")}, names


def test_host_sync_in_the_arrival_path_would_be_caught():
  """The check above is not vacuous: a host sync fails to trace."""
  def syncing(x):
    return x * float(x.sum())
  with pytest.raises(jax.errors.ConcretizationTypeError):
    jax.make_jaxpr(syncing)(jnp.ones(3))


def test_deterministic_bit_for_bit():
  params, arrivals, staleness = _arrivals(14)
  first = _run(hj.heloco(num_workers=5), params, arrivals, staleness)[-1][0]
  second = _run(hj.heloco(num_workers=5), params, arrivals, staleness)[-1][0]
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
    np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------- optax composition


def test_chain_passes_staleness_through():
  params, arrivals, staleness = _arrivals(15, n=6)
  chained = optax.chain(optax.clip_by_global_norm(1.0), hj.heloco(num_workers=3,
                                                                   weighting="polynomial"))
  manual = hj.heloco(num_workers=3, weighting="polynomial")
  c_state, m_state = chained.init(params), manual.init(params)
  for delta, tau in zip(arrivals, staleness):
    c_updates, c_state = chained.update(delta, c_state, params, staleness=tau)
    clipped, _ = optax.clip_by_global_norm(1.0).update(delta, optax.EmptyState())
    m_updates, m_state = manual.update(clipped, m_state, params, staleness=tau)
    _assert_tree_close(c_updates, m_updates)
  assert int(c_state[1].staleness) == staleness[-1]


def test_inject_hyperparams_changes_reach_update_and_lookahead():
  params, arrivals, _ = _arrivals(16, n=3)
  tx = optax.inject_hyperparams(hj.heloco, static_args=("num_workers",))(
      learning_rate=0.7, momentum=0.9, num_workers=2)
  state = tx.init(params)
  _, state = jax.jit(tx.update)(arrivals[0], state, params, staleness=0)
  state.hyperparams["learning_rate"] = jnp.asarray(0.35)
  updates, state = jax.jit(tx.update)(arrivals[1], state, params, staleness=1)
  plain = hj.heloco(0.35, 0.9, num_workers=2)
  _, plain_state = plain.update(arrivals[0], plain.init(params), params, staleness=0)
  want, plain_state = plain.update(arrivals[1], plain_state, params, staleness=1)
  _assert_tree_close(updates, want)
  _assert_tree_close(hj.lookahead_params(state, params), hj.lookahead_params(plain_state, params))


def test_polynomial_weight_values_and_missing_staleness():
  np.testing.assert_allclose(hj.arrival_weight(3, num_workers=4, weighting="polynomial"),
                             0.5 / 2.0, rtol=1e-7)
  np.testing.assert_allclose(hj.arrival_weight(None, num_workers=4, weighting="constant"), 0.5)
  assert float(hj.arrival_weight(9, num_workers=None, weighting="polynomial")) == 1.0
  assert float(hj.arrival_weight(9, num_workers=4, weighting="none")) == 1.0
  tx = hj.mla(num_workers=4, weighting="polynomial")
  params = {"w": jnp.ones(3)}
  with pytest.raises(ValueError, match="staleness=None"):
    tx.update(params, tx.init(params), params)
  with pytest.raises(ValueError, match="staleness=-1"):
    tx.update(params, tx.init(params), params, staleness=-1)


def test_diagnostics_keys_follow_the_leaf_paths():
  params, arrivals, staleness = _arrivals(17, n=3)
  _, state = _run(hj.heloco(), params, arrivals, staleness)[-1]
  diagnostics = hj.heloco_diagnostics(state)
  assert {"cosine/dense/kernel", "cosine/dense/bias", "cosine/embed",
          "rotation/embed", "shrinkage/embed", "branch/embed", "confidence/embed"} <= set(diagnostics)
  counts = [int(diagnostics[f"branch_count/{b}"]) for b in hj.BRANCH_NAMES]
  assert sum(counts) == 3 and int(diagnostics["staleness"]) == staleness[-1]


# ------------------------------------------------------------- validation


_ERRORS = [
    (hj.heloco, dict(learning_rate=0.0), "learning_rate=0.0"),
    (hj.heloco, dict(learning_rate=-1.0), "learning_rate=-1.0"),
    (hj.mla, dict(learning_rate=float("nan")), "learning_rate=nan"),
    (hj.async_nesterov, dict(learning_rate=0), "learning_rate=0"),
    (hj.delayed_nesterov, dict(learning_rate=-0.1, buffer_size=2), "learning_rate=-0.1"),
    (hj.heloco, dict(momentum=1.0), "momentum=1.0"),
    (hj.mla, dict(momentum=-0.1), "momentum=-0.1"),
    (hj.async_nesterov, dict(momentum=1.5), "momentum=1.5"),
    (hj.delayed_nesterov, dict(learning_rate=0.1, momentum=1.0, buffer_size=2), "momentum=1.0"),
    (hj.heloco, dict(keep_threshold=1.5), "keep_threshold=1.5"),
    (hj.heloco, dict(keep_threshold=-1.01), "keep_threshold=-1.01"),
    (hj.heloco, dict(keep_threshold=0.1, bad_threshold=0.1), "bad_threshold=0.1"),
    (hj.heloco, dict(keep_threshold=0.1, bad_threshold=0.3), "bad_threshold=0.3"),
    (hj.heloco, dict(shrink_strength=-0.5), "shrink_strength=-0.5"),
    (hj.heloco, dict(rotate_strength=-1.0), "rotate_strength=-1.0"),
    (hj.heloco, dict(confidence_scale=-3.0), "confidence_scale=-3.0"),
    (hj.heloco, dict(max_shrink=-0.1), "max_shrink=-0.1"),
    (hj.heloco, dict(max_shrink=1.5), "max_shrink=1.5"),
    (hj.heloco, dict(eps=0.0), "eps=0.0"),
    (hj.heloco, dict(rotate_schedule="cosine"), "rotate_schedule='cosine'"),
    (hj.heloco, dict(weight_order="during"), "weight_order='during'"),
    (hj.heloco, dict(scope="layer"), "scope='layer'"),
    (hj.heloco, dict(weighting="linear"), "weighting='linear'"),
    (hj.mla, dict(weighting="exp"), "weighting='exp'"),
    (hj.async_nesterov, dict(weighting="Constant"), "weighting='Constant'"),
    (hj.delayed_nesterov, dict(learning_rate=0.1, buffer_size=2, weighting="x"), "weighting='x'"),
    (hj.delayed_nesterov, dict(learning_rate=0.1, buffer_size=0), "buffer_size=0"),
    (hj.delayed_nesterov, dict(learning_rate=0.1, buffer_size=2.5), "buffer_size=2.5"),
    (hj.delayed_nesterov, dict(learning_rate=0.1), "buffer_size=None"),
    (hj.delayed_nesterov, dict(learning_rate=0.1, buffer_size=4, c=0.3), "c=0.3"),
    (hj.delayed_nesterov, dict(learning_rate=0.1, buffer_size=4, c=-0.1), "c=-0.1"),
    (hj.delayed_nesterov, dict(learning_rate=0.1, num_workers=0), "num_workers=0"),
    (hj.heloco, dict(num_workers=0), "num_workers=0"),
    (hj.mla, dict(num_workers=-2), "num_workers=-2"),
    (hj.async_nesterov, dict(num_workers=2.0), "num_workers=2.0"),
    (hj.heloco, dict(num_workers=True), "num_workers=True"),
    (hj.heloco_correct, dict(pseudo_grads=jnp.ones(2), momentum=jnp.ones(2), scope="all"),
     "scope='all'"),
    (hj.heloco_correct, dict(pseudo_grads=jnp.ones(2), momentum=jnp.ones(2), max_shrink=2.0),
     "max_shrink=2.0"),
    (hj.heloco, dict(learning_rate="fast"), "learning_rate='fast'"),
]


@pytest.mark.parametrize("factory, kwargs, named", _ERRORS,
                         ids=[f"{f.__name__}-{n}" for f, _, n in _ERRORS])
def test_invalid_arguments_fail_at_construction_with_a_clear_message(factory, kwargs, named):
  with pytest.raises(ValueError) as error:
    factory(**kwargs)
  message = str(error.value)
  assert named in message, message  # names the argument and its value
  assert "allowed:" in message, message  # and says what is allowed
  assert message.startswith(factory.__name__ + ":"), message


def test_valid_edge_values_are_accepted():
  hj.heloco(keep_threshold=-1.0, bad_threshold=-2.0)  # the never-correct identity
  hj.heloco(keep_threshold=1.0, max_shrink=1.0, shrink_strength=0.0, rotate_strength=0.0,
            confidence_scale=0.0)
  hj.heloco(keep_threshold=0.1, bad_threshold=0.3, rotate_schedule="eq14")  # c_bad unused
  hj.mla(momentum=0.0)
  hj.delayed_nesterov(0.1, buffer_size=4, c=0.25)
  hj.delayed_nesterov(0.1, num_workers=3)  # N defaults to K
  assert hj.delayed_nesterov(0.1, num_workers=3) is not None


def test_outer_momentum_is_found_in_every_async_rule_state():
  params = {"w": jnp.ones((3,)), "b": jnp.zeros((2,))}
  delta = {"w": jnp.full((3,), 0.5), "b": jnp.ones((2,))}
  for tx in (hj.mla(0.7, 0.9), hj.heloco(0.7, 0.9), hj.async_nesterov(0.07, 0.9),
             hj.delayed_nesterov(0.07, 0.9, buffer_size=1)):
    state = tx.init(params)
    _, state = tx.update(delta, state, params, staleness=0)
    momentum = hj.outer_momentum(state)
    assert jax.tree.structure(momentum) == jax.tree.structure(params)
    assert float(jnp.abs(momentum["w"]).sum()) > 0  # the arrival went into m
  with pytest.raises(ValueError, match="outer_momentum: .* holds 0"):
    hj.outer_momentum(optax.sgd(1.0).init(params))


# ------------------------------------------- optax.inject_hyperparams, no static_args


_INJECTED = [
    (hj.heloco, dict(learning_rate=0.5, momentum=0.9, num_workers=4)),
    (hj.heloco, dict(learning_rate=0.7, momentum=0.95, num_workers=3, weighting="polynomial",
                     keep_threshold=0.3, bad_threshold=-0.1, rotate_schedule="eq14",
                     weight_order="after")),
    (hj.mla, dict(learning_rate=0.7, momentum=0.9, num_workers=5)),
    (hj.mla, dict(learning_rate=0.3, momentum=0.99, num_workers=7, weighting="polynomial")),
    (hj.async_nesterov, dict(learning_rate=0.07, momentum=0.9, num_workers=5)),
    (hj.async_nesterov, dict(learning_rate=0.1, momentum=0.8, num_workers=3,
                             weighting="polynomial")),
    (hj.delayed_nesterov, dict(learning_rate=0.07, momentum=0.9, num_workers=5)),
    (hj.delayed_nesterov, dict(learning_rate=0.07, momentum=0.9, num_workers=5, buffer_size=3,
                               c=0.1)),
    (hj.delayed_nesterov, dict(learning_rate=0.5, momentum=0.9, num_workers=7, buffer_size=7,
                               c=1 / 7, weighting="polynomial")),
    (hj.delayed_nesterov, dict(learning_rate=0.2, momentum=0.9, buffer_size=1, c=0.6)),
    (hj.cgad, dict(learning_rate=0.01, decay=0.2, cutoff=16.0)),
    (hj.cgad, dict(learning_rate=0.01, b1=0.8, decay=0.0, cutoff=math.inf)),
]


def _assert_trees_equal(a, b):
  """Equal up to float32 rounding: inject_hyperparams holds η, μ, c as float32 arrays, where
  the plain factory folds Python floats (so 1 − μ rounds once more or less)."""
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(leaves_a) == len(leaves_b)
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("factory, kwargs", _INJECTED,
                         ids=[f"{f.__name__}-{i}" for i, (f, _) in enumerate(_INJECTED)])
def test_inject_hyperparams_without_static_args_matches_the_plain_factory(factory, kwargs, jit):
  params, arrivals, staleness = _arrivals(18, n=7)
  plain = factory(**kwargs)
  injected = optax.inject_hyperparams(factory)(**kwargs)  # num_workers etc. become arrays
  wrap = jax.jit if jit else (lambda f: f)
  plain_state = wrap(plain.init)(params)
  injected_state = wrap(injected.init)(params)
  _assert_trees_equal(injected_state.inner_state, plain_state)
  plain_update, injected_update = wrap(plain.update), wrap(injected.update)
  plain_params = injected_params = params
  for delta, tau in zip(arrivals, staleness):
    want, plain_state = plain_update(delta, plain_state, plain_params, staleness=tau)
    got, injected_state = injected_update(delta, injected_state, injected_params, staleness=tau)
    _assert_trees_equal(got, want)
    _assert_trees_equal(injected_state.inner_state, plain_state)
    plain_params = optax.apply_updates(plain_params, want)
    injected_params = optax.apply_updates(injected_params, got)
  if factory in (hj.mla, hj.heloco):
    _assert_trees_equal(hj.lookahead_params(injected_state, injected_params),
                        hj.lookahead_params(plain_state, plain_params))


@pytest.mark.parametrize("factory, kwargs", _INJECTED,
                         ids=[f"{f.__name__}-{i}" for i, (f, _) in enumerate(_INJECTED)])
def test_a_jitted_inject_hyperparams_init_holds_no_tracer_and_rho_reads_its_k(factory, kwargs):
  from heloco_jax.outer.weighting import arrival_weighting  # pylint: disable=g-import-not-at-top
  params = {"w": jnp.ones(3)}
  plain = factory(**kwargs).init(params)
  injected = jax.jit(optax.inject_hyperparams(factory)(**kwargs).init)(params)
  assert "Tracer" not in str(jax.tree.structure(injected))  # static data: no leaked tracer
  for tau in (0, 1, 5):
    assert arrival_weighting(injected)(tau) == pytest.approx(arrival_weighting(plain)(tau))
  assert len(arrival_weighting(injected).weightings) == len(arrival_weighting(plain).weightings)


@pytest.mark.parametrize("factory", [hj.heloco, hj.mla, hj.async_nesterov, hj.delayed_nesterov])
def test_a_learning_rate_schedule_is_refused_naming_optaxs_wrapper(factory):
  with pytest.raises(ValueError, match=rf"allowed: a number > 0; for a schedule, "
                                       rf"optax.inject_hyperparams\(hj.{factory.__name__}\)"):
    factory(optax.linear_schedule(0.7, 0.1, 10), num_workers=2)


def test_inject_hyperparams_example_from_the_docs():
  params = {"w": jnp.ones(3)}
  tx = optax.inject_hyperparams(hj.heloco)(learning_rate=0.5, momentum=0.9, num_workers=4)
  state = tx.init(params)
  assert int(state.hyperparams["num_workers"]) == 4
  updates, state = jax.jit(tx.update)({"w": jnp.full(3, 0.2)}, state, params, staleness=1)
  # First update: m = 0, so HeLoCo is MLA: −η·((1 − μ)·ρΔ·μ + ρΔ) with ρ = 1/2.
  np.testing.assert_allclose(updates["w"], -0.5 * 0.1 * (1 + 0.9 * 0.1), rtol=1e-6)


@pytest.mark.parametrize("factory, kwargs, named", [
    (hj.heloco, dict(num_workers=jnp.asarray(0)), "num_workers=0"),
    (hj.mla, dict(num_workers=jnp.asarray(2.0)), "num_workers=Array(2."),
    (hj.async_nesterov, dict(num_workers=np.asarray(-1)), "num_workers=-1"),
    (hj.delayed_nesterov, dict(learning_rate=0.1, buffer_size=jnp.asarray(0)), "buffer_size=0"),
    (hj.delayed_nesterov, dict(learning_rate=0.1, buffer_size=jnp.asarray(4), c=0.3),
     "c=0.3"),
    (hj.delayed_nesterov, dict(learning_rate=0.1, buffer_size=jnp.ones(2, jnp.int32)),
     "buffer_size=Array([1, 1]"),
])
def test_concrete_array_arguments_are_validated_as_numbers(factory, kwargs, named):
  with pytest.raises(ValueError) as error:
    factory(**kwargs)
  assert named in str(error.value) and "allowed:" in str(error.value), str(error.value)


def test_delayed_nesterov_accepts_c_of_one_over_n_rounded_to_float32():
  # inject_hyperparams holds c = 1/3 as float32 0.33333334 > 1/3.
  hj.delayed_nesterov(0.1, buffer_size=3, c=np.float32(1 / 3))
  with pytest.raises(ValueError, match="c=0.34"):
    hj.delayed_nesterov(0.1, buffer_size=3, c=0.34)
