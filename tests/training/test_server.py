"""The server side of every runtime (heloco_jax/training/server.py): one update per arrival group."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tiny

import heloco_jax as hj
from heloco_jax import outer
from heloco_jax.lm import harness
from heloco_jax.training import methods, rejection, server


def _tree(seed, scale=1.0):
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.normal(size=(4, 3)) * scale, jnp.float32),
          "b": jnp.asarray(rng.normal(size=3) * scale, jnp.float32)}


def _by_hand(tx, params, deltas_and_taus):
  """θ after applying ``tx`` to each (Δ, τ) in turn, with optax directly."""
  state = tx.init(params)
  for delta, tau in deltas_and_taus:
    updates, state = tx.update(delta, state, params, staleness=tau)
    params = optax.apply_updates(params, updates)
  return params, state


def _server(config, params):
  """A server of ``config``'s method's own rule (the registry's, with the config's options);
  ρ for a grace window comes from the rule's state."""
  method = methods.get(config.method)
  return server.OuterServer(
      method.make_outer(config.num_workers, harness.outer_options(config)), params,
      lookahead=method.lookahead_dispatch(None))


def _poisoned(tree, value):
  return rejection.poison(tree, value) if value else tree


def _close(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def test_single_arrivals_apply_the_rule_and_log_the_cosine_with_the_momentum_they_meet():
  config = tiny.config("mla", 3)
  params = _tree(0)
  srv = _server(config, params)
  deltas = [(_tree(1, 0.1), 0), (_tree(2, 0.1), 1)]
  rows = [srv.update([tau], delta) for delta, tau in deltas]
  expected, state = _by_hand(hj.mla(0.7, 0.9, num_workers=3), params, deltas)
  _close(srv.params, expected)
  assert rows[0] == [{"reason": None, "cosine_mean": 0.0}]  # m = 0 at the first arrival
  # the second Δ meets m after the first update: cos per leaf, averaged (NumPy)
  momentum = outer.outer_momentum(_by_hand(hj.mla(0.7, 0.9, num_workers=3), params,
                                           deltas[:1])[1])
  cos = [np.dot(np.ravel(d), np.ravel(m)) / np.linalg.norm(d) / np.linalg.norm(m)
         for d, m in zip(jax.tree.leaves(deltas[1][0]), jax.tree.leaves(momentum))]
  assert rows[1][0]["cosine_mean"] == pytest.approx(np.mean(cos), abs=1e-6)
  _close(srv.dispatch_point(), srv.params)  # mla dispatches from θ by default
  assert _server(tiny.config("heloco", 3), params).lookahead


def test_a_grace_group_is_one_update_with_the_weighted_mean_pseudo_gradient():
  config = tiny.config("mla", 3, **{"outer.weighting": "polynomial"})
  params = _tree(0)
  srv = _server(config, params)
  deltas, taus = [_tree(1, 0.1), _tree(2, 0.1)], [1, 3]
  rho = [float(outer.arrival_weight(t, num_workers=3, weighting="polynomial")) for t in taus]
  assert rho[0] != rho[1]
  # ρ(τ_max)·Δ must equal mean_j ρ_j·Δ_j (scheduler docstring, "async")
  combined = jax.tree.map(lambda a, b: (rho[0] * a + rho[1] * b) / (2 * rho[1]), *deltas)
  rows = srv.update(taus, *deltas)
  expected, _ = _by_hand(hj.mla(0.7, 0.9, num_workers=3, weighting="polynomial"), params,
                         [(combined, 3)])
  _close(srv.params, expected)
  assert [r["reason"] for r in rows] == [None, None]


def test_non_finite_pseudo_gradients_are_rejected_and_never_touch_theta():
  config = tiny.config("heloco", 3)
  params = _tree(0)
  srv = _server(config, params)
  before = jax.device_get((srv.params, srv.outer_state))
  rows = srv.update([0, 0], _poisoned(_tree(1, 0.1), "nan"), _poisoned(_tree(2, 0.1), "inf"))
  assert [r["reason"] for r in rows] == ["nan", "inf"] and all(len(r) == 1 for r in rows)
  after = jax.device_get((srv.params, srv.outer_state))
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before),
                                                   jax.tree.leaves(after)))
  # One bad and one good arrival: only the good one is applied, as a single update.
  rows = srv.update([0, 0], _tree(1, 0.1), _poisoned(_tree(2, 0.1), "nan"))
  assert rows[0]["reason"] is None and rows[1] == {"reason": "nan"}
  assert "branch_count/keep" in rows[0]
  alone = _server(config, params)
  alone.update([0], _tree(1, 0.1))
  _close(srv.params, alone.params)


def _heloco_server(params, **kwargs):
  return server.OuterServer(hj.heloco(0.7, 0.9, num_workers=3), params, lookahead=True,
                            **kwargs)


def test_the_dispatch_point_is_bit_for_bit_the_eager_lookahead_point():
  """One jitted pass per stage (η·μ·m, then θ − that) rounds as hj.lookahead_params's eager
  ops do: no fused multiply-add changes the last bit of where workers start."""
  params = _tree(0)
  srv = _heloco_server(params)
  for i in range(4):
    start = srv.dispatch(worker=0)
    srv.arrive(jax.tree.map(lambda x, d: d - x, start, _tree(10 + i, 0.1)), worker=0)
  start = srv.dispatch_point()
  eager = hj.lookahead_params(srv.outer_state, srv.params)
  assert float(jnp.abs(hj.outer_momentum(srv.outer_state)["w"]).max()) > 0  # m ≠ 0
  for got, want in zip(jax.tree.leaves(start), jax.tree.leaves(eager)):
    np.testing.assert_array_equal(got, want)


def test_arrival_rows_hold_heloco_diagnostics_per_block_false_without_the_staleness():
  params = _tree(0)
  srv = _heloco_server(params)
  for i in range(2):
    srv.dispatch(worker=0)
    row = srv.arrive(_tree(1 + i, 0.1), worker=0)
  summary = jax.device_get(hj.heloco_diagnostics(srv.outer_state, per_block=False))
  assert summary.pop("staleness") == 0
  assert sorted(summary) == ["branch_count/keep", "branch_count/pass", "branch_count/rotate",
                             "branch_count/shrink", "cosine_mean", "relative_correction",
                             "rotation_mean", "shrinkage_mean", "weight"]
  assert {k: row[k] for k in summary} == {k: v.item() for k, v in summary.items()}


@pytest.mark.parametrize("method", ["heloco", "mla", "async_nesterov"])
def test_sub_states_are_found_once_not_searched_at_every_arrival(method, monkeypatch):
  from heloco_jax.outer import lookahead  # pylint: disable=g-import-not-at-top
  calls = []
  for module, name in ((lookahead, "find_state"), (lookahead, "_find_with_path"),
                       (server, "find_state")):  # also a name imported into the server
    if hasattr(module, name):
      original = getattr(module, name)
      monkeypatch.setattr(module, name,
                          lambda *a, original=original, name=name: calls.append(name) or original(*a))
  params = _tree(0)
  tx = {"heloco": lambda: optax.chain(optax.clip_by_global_norm(10.0), hj.heloco(num_workers=3)),
        "mla": lambda: hj.mla(num_workers=3), "async_nesterov": hj.async_nesterov}[method]()
  srv = server.OuterServer(tx, params, lookahead=method != "async_nesterov")
  assert calls  # found when built ...
  for i in range(3):  # ... and traced by the first arrivals' compiled programs
    srv.dispatch(worker=0)
    srv.arrive(_tree(1 + i, 0.1), worker=0)
  calls.clear()
  for i in range(5):
    srv.dispatch(worker=0)
    row = srv.arrive(_tree(5 + i, 0.1), worker=0)
  assert calls == []  # ... but not walked at any later dispatch or arrival
  assert row["applied"] and ("cosine_mean" in row)
