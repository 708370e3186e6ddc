"""HeLoCo's merge order under a quorum (hj.heloco(merge_order=...); ALGORITHMS.md, "Merge order
under a quorum"): both orders against the float64 NumPy reference written from the docs
(tests/numpy_reference.py, ``HeLoCo.step_group``), through the optax rule (jitted, tree and
packed) and the server's grouped update; quorum 1 gives the same bits either way; the
refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import optax
import pytest

import heloco_jax as hj
from heloco_jax.outer import packing
from heloco_jax.training import server as server_lib

ORDERS = ("merge_then_correct", "correct_then_merge")
PARAMS = {"a": jnp.zeros((3, 4)), "b": jnp.zeros(5)}
# Rounding of float32 against float64 over a few updates of O(1) pseudo-gradients.
ATOL = 1e-5


def _groups(seed, sizes):
  """Groups of arrivals (trees, τ_j, ω_j of mean 1) that take every branch: a drift that
  turns sign between groups, around noise of the same size."""
  rng = np.random.default_rng(seed)
  out = []
  for k, n in enumerate(sizes):
    drift = 0.6 if k % 3 else -0.4
    deltas = [jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) + drift, jnp.float32),
                           PARAMS) for _ in range(n)]
    omegas = rng.uniform(0.5, 1.5, size=n)
    out.append((deltas, [int(t) for t in rng.integers(0, 4, size=n)],
                list(n * omegas / omegas.sum())))
  return out


def _reference(order, groups, **options):
  opt = ref.HeLoCo(0.7, 0.9, **options).init(jax.tree.leaves(PARAMS))
  theta = ref.as_tree(jax.tree.leaves(PARAMS))
  for deltas, taus, omegas in groups:
    theta = opt.step_group(theta, [jax.tree.leaves(d) for d in deltas], taus,
                           [w / len(deltas) for w in omegas], order)
  return theta, opt


def _close(tree, leaves):
  return max(float(np.max(np.abs(np.asarray(a, np.float64) - b)))
             for a, b in zip(jax.tree.leaves(tree), leaves))


OPTIONS = [dict(num_workers=4, weighting="polynomial"),
           dict(num_workers=4, weighting="constant", weight_order="after"),
           dict(num_workers=None, scope="tree", rotate_schedule="eq14")]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("packed", [False, True])
def test_the_rules_group_update_matches_the_reference(order, options, packed):
  groups = _groups(0, [1, 3, 2, 3, 1, 2])
  tx = hj.heloco(0.7, 0.9, merge_order=order, **options)
  params = packing.pack(PARAMS) if packed else PARAMS
  state = tx.init(params)
  update = jax.jit(lambda d, s, t, w: tx.update(d, s, None, staleness=t, group_weights=w))
  for deltas, taus, omegas in groups:
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs),
                           *[packing.pack(d) if packed else d for d in deltas])
    updates, state = update(stacked, state, jnp.asarray(taus, jnp.int32),
                            jnp.asarray(omegas, jnp.float32) / len(deltas))
    params = optax.apply_updates(params, updates)
  theta, opt = _reference(order, groups, **options)
  params = packing.unpack(params) if packed else params
  assert _close(params, theta) < ATOL
  assert _close(packing.unpack(state.momentum) if packed else state.momentum, opt.m) < ATOL
  if order == "correct_then_merge":  # the last group's arrivals' branches, summed
    counts = sum(np.asarray(info["branch_counts"]) for info in opt.infos)
    assert np.array_equal(np.asarray(state.info.branch_counts), counts)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("packed", [False, True])
def test_the_servers_grouped_update_matches_the_reference(order, packed):
  """Today's grouped HeLoCo (the server merges, the rule corrects once) is merge-then-correct;
  correct-then-merge gives the rule the group whole."""
  options = dict(num_workers=4, weighting="polynomial")
  groups = _groups(1, [2, 3, 1, 3, 2])
  server = server_lib.OuterServer(hj.heloco(0.7, 0.9, merge_order=order, **options), PARAMS,
                                  lookahead=True, packed=packed)
  for deltas, taus, omegas in groups:
    rows = server.update(taus, *deltas, weights=omegas)
    assert all(row["reason"] is None for row in rows)
  theta, opt = _reference(order, groups, **options)
  assert _close(server.params, theta) < ATOL
  assert _close(server.outer_state.momentum, opt.m) < ATOL


def test_the_two_orders_differ_on_a_group_and_agree_on_single_arrivals_bit_for_bit():
  groups = _groups(2, [3, 2, 3, 3])
  thetas = {}
  for order in ORDERS:
    singles = server_lib.OuterServer(hj.heloco(0.7, 0.9, num_workers=4, merge_order=order),
                                     PARAMS, lookahead=True)
    grouped = server_lib.OuterServer(hj.heloco(0.7, 0.9, num_workers=4, merge_order=order),
                                     PARAMS, lookahead=True)
    for deltas, taus, omegas in groups:
      for delta, tau in zip(deltas, taus):
        singles.update([tau], delta)
        # a group whose other arrival was rejected applies its one finite arrival alone
        grouped.update([tau, 0], delta, jax.tree.map(lambda x: x * jnp.nan, delta),
                       weights=[1.0, 1.0])
    thetas[order] = (singles.params, grouped.params, singles.outer_state.momentum)
  for i in range(3):
    assert all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(thetas[ORDERS[0]][i]), jax.tree.leaves(thetas[ORDERS[1]][i])))
  for order in ORDERS:
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(thetas[order][0]),
                                                   jax.tree.leaves(thetas[order][1])))
  merged, corrected = (_reference(order, groups, num_workers=4)[0] for order in ORDERS)
  assert max(float(np.max(np.abs(a - b))) for a, b in zip(merged, corrected)) > 1e-3


def test_a_default_state_keeps_its_structure_and_the_option_is_static():
  default = hj.heloco(0.7, 0.9, num_workers=4).init(PARAMS)
  explicit = hj.heloco(0.7, 0.9, num_workers=4, merge_order="merge_then_correct").init(PARAMS)
  other = hj.heloco(0.7, 0.9, num_workers=4, merge_order="correct_then_merge").init(PARAMS)
  assert str(jax.tree.structure(default)) == str(jax.tree.structure(explicit))
  assert "ArrivalWeighting(num_workers=4, weighting='constant')" in str(
      jax.tree.structure(default))
  assert len(jax.tree.leaves(other)) == len(jax.tree.leaves(default))
  assert server_lib.corrects_then_merges(other) and not server_lib.corrects_then_merges(default)
  assert float(hj.heloco_diagnostics(other)["weight"]) == 1.0  # read as before (no arrival)


# ------------------------------------------------ runs and refusals


K, D = 4, 6
_W = np.random.default_rng(0).normal(size=(D, 1)).astype(np.float32)


def _stream(i):
  rng = np.random.default_rng(10 + i)
  while True:
    x = rng.normal(size=(8, D)).astype(np.float32)
    yield {"x": x, "y": x @ _W}


def _loss(p, b):
  return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


def _run(syncer=None, steps=160, **method_options):
  return hj.simulate(_loss, {"w": jnp.zeros((D, 1))}, [_stream(i) for i in range(K)],
                     method="heloco", budget=hj.Budget(steps=steps), inner_steps=5,
                     speeds=[1.0, 1.1, 1.3, 1.6], inner_tx=optax.sgd(0.05), syncer=syncer,
                     method_options=method_options or None)


def test_a_quorum_run_takes_either_order_and_the_default_is_todays_bits():
  plain = _run(hj.Syncer(quorum=2))
  explicit = _run(hj.Syncer(quorum=2), merge_order="merge_then_correct")
  corrected = _run(hj.Syncer(quorum=2), merge_order="correct_then_merge")
  assert np.array_equal(np.asarray(plain.params["w"]), np.asarray(explicit.params["w"]))
  assert plain.history == explicit.history
  assert not np.array_equal(np.asarray(plain.params["w"]), np.asarray(corrected.params["w"]))
  assert np.isfinite(np.asarray(corrected.params["w"])).all()
  assert corrected.summary["outer_updates"] == plain.summary["outer_updates"]


@pytest.mark.parametrize("make, message", [
    (lambda: _run(merge_order="correct_then_merge", steps=20),
     "merge_order='correct_then_merge' is not allowed without groups of arrivals"),
    (lambda: _run(hj.Syncer(quorum=3, aggregate=hj.aggregate.median()),
                  merge_order="correct_then_merge", steps=20),
     "merge_order='correct_then_merge' is not allowed with aggregate=median()"),
    (lambda: hj.simulate(_loss, {"w": jnp.zeros((D, 1))}, [_stream(i) for i in range(K)],
                         method="mla", budget=hj.Budget(steps=20), inner_steps=5,
                         method_options={"merge_order": "correct_then_merge"}),
     "method_options key 'merge_order' is not allowed with method='mla'"),
    (lambda: hj.heloco(merge_order="correct_after"), "merge_order='correct_after'"),
    (lambda: server_lib.OuterServer(optax.chain(
        optax.clip(1.0), hj.heloco(merge_order="correct_then_merge")), PARAMS),
     "merge_order='correct_then_merge' is not allowed inside a chain"),
])
def test_the_option_is_refused_where_it_cannot_apply_in_one_line(make, message):
  with pytest.raises(ValueError) as error:
    make()
  assert message in str(error.value) and "\n" not in str(error.value)


def test_the_cli_key_reaches_the_rule_and_is_refused_where_it_cannot_apply():
  import tiny  # pylint: disable=g-import-not-at-top
  from heloco_jax.cli.configs import validation  # pylint: disable=g-import-not-at-top
  from heloco_jax.lm import harness  # pylint: disable=g-import-not-at-top
  config = tiny.config("heloco", num_workers=3, **{"syncer.quorum": 2, "budget.tokens": 1600,
                                                   "outer.merge_order": "correct_then_merge"})
  validation.validate(config)
  assert harness.method_options(config)["merge_order"] == "correct_then_merge"
  default = tiny.config("heloco", num_workers=3)
  assert "merge_order" not in harness.method_options(default)  # older workdirs' options
  for method, overrides, message in (
      ("mla", {"syncer.quorum": 2}, "with method='mla'"),
      ("heloco", {}, "without groups of arrivals"),
      ("heloco", {"syncer.quorum": 3, "syncer.aggregate": "median()"}, "syncer.aggregate")):
    config = tiny.config(method, num_workers=3,
                         **{"outer.merge_order": "correct_then_merge", **overrides})
    with pytest.raises(Exception) as error:
      validation.validate(config)
    assert "config.outer.merge_order='correct_then_merge' is not allowed" in str(error.value)
    assert message in str(error.value)
