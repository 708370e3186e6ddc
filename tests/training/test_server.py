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


# ------------------------------------------------ the packed layout (ALGORITHMS.md, "Packed outer state")


def _layouts_side_by_side(tx, deltas, lookahead):
  """(tree server, packed server, rows of each) after the same arrivals, single and grouped."""
  servers = [server.OuterServer(tx, _tree(0), lookahead=lookahead, packed=packed)
             for packed in (False, True)]
  rows = [[], []]
  for s, log in zip(servers, rows):
    for i, delta in enumerate(deltas):
      starts = [s.dispatch(0), s.dispatch(1)]
      if i % 3 == 2:  # a grace group of two
        log.extend(s.update([1, 2], delta, _tree(50 + i, 0.1), fetch=True))
      else:
        log.append(s.arrive(delta, 0))
      log.append({"start": starts[0]})
  return servers, rows


@pytest.mark.parametrize("method", ["heloco", "mla", "async_nesterov", "delayed_nesterov"])
def test_a_packed_server_is_the_tree_server_within_float32_rounding(method):
  """θ, the outer state, the dispatch points and every row's diagnostics of a packed server
  (θ and the state in one buffer, per-leaf sums as segment sums) within 1e-5 of the tree
  server's, HeLoCo's branches equal; a non-finite Δ is rejected alike."""
  spec = methods.METHODS[method]
  tx = spec.make_outer(4, {})
  deltas = [_tree(10 + i, 0.1) for i in range(8)]
  deltas[1] = jax.tree.map(lambda x: -x, deltas[0])  # opposes the momentum: HeLoCo shrinks
  deltas[4] = {"w": deltas[4]["w"].at[0, 0].set(jnp.nan), "b": deltas[4]["b"]}
  (tree, packed), (tree_rows, packed_rows) = _layouts_side_by_side(
      tx, deltas, spec.lookahead_dispatch(None))
  assert packed.packed and not tree.packed
  for a, b in zip(jax.tree.leaves(packed.get()), jax.tree.leaves(tree.get())):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert jax.tree.structure(packed.get()) == jax.tree.structure(tree.get())
  assert len(tree_rows) == len(packed_rows)
  for got, want in zip(packed_rows, tree_rows):
    assert got.keys() == want.keys()
    for key, value in want.items():
      if key == "start":
        for a, b in zip(jax.tree.leaves(got[key]), jax.tree.leaves(value)):
          np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
      elif isinstance(value, float):
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
      else:
        assert got[key] == value, key
  assert any(r.get("reason") == "nan" for r in packed_rows)
  if method == "heloco":
    assert any(r.get("branch_count/shrink", 0) > 0 for r in packed_rows)


def test_a_packed_servers_checkpoint_is_the_trees_and_restores_into_either_layout():
  """``get`` gives trees (a checkpoint does not know the layout); ``set`` packs them again, so
  a run checkpointed in one layout resumes in the other, and a packed server restored from
  its own checkpoint continues bit for bit."""
  tx = hj.heloco(0.7, 0.9, num_workers=2)
  deltas = [_tree(20 + i, 0.1) for i in range(6)]

  def run(s, part):
    for delta in part:
      s.dispatch(0)
      s.arrive(delta, 0)
    return s
  packed = run(server.OuterServer(tx, _tree(0), lookahead=True, packed=True), deltas[:3])
  params, state = packed.get()
  assert jax.tree.structure(state) == jax.tree.structure(tx.init(_tree(0)))
  resumed = server.OuterServer(tx, _tree(0), lookahead=True, packed=True)
  resumed.set(params, state)
  as_tree = server.OuterServer(tx, _tree(0), lookahead=True)
  as_tree.set(params, state)
  run(packed, deltas[3:])
  run(resumed, deltas[3:])
  run(as_tree, deltas[3:])
  for a, b, c in zip(*(jax.tree.leaves(s.get()) for s in (packed, resumed, as_tree))):
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-6)


def test_packs_outer_packs_registry_rules_on_accelerators_and_refuses_what_it_cannot():
  decide = lambda layout, **kw: server.packs_outer(
      layout, **{"rule": True, "user_rule": False, "sharded": False, **kw})
  assert decide("auto", platform="cpu") is False  # a CPU runs the tree as fast: bits kept
  assert decide("auto", platform="gpu") is True
  assert decide("auto", platform="tpu") is True
  assert decide("auto", platform="gpu", user_rule=True) is False  # a chain may read leaves
  assert decide("auto", platform="gpu", sharded=True) is False
  assert decide("auto", platform="gpu", rule=False) is False  # DDP: no outer rule
  assert decide("packed", platform="cpu", user_rule=True) is True
  assert decide("tree", platform="gpu") is False
  with pytest.raises(ValueError, match="outer_layout='packed' is not allowed with θ sharded"):
    decide("packed", sharded=True)
  with pytest.raises(ValueError, match=r"outer_layout='flat' is not allowed; allowed: one of "
                                       r"\['auto', 'tree', 'packed'\]"):
    decide("flat")
  with pytest.raises(ValueError, match="packed=True is not allowed without an outer rule"):
    server.OuterServer(None, _tree(0), packed=True)
  with pytest.raises(ValueError, match=r"^outer_layout='Packed' is not allowed; allowed: one"):
    hj.simulated_runtime(outer_layout="Packed")  # type: ignore[arg-type]


# With fragments (17 s) under -m slow: the default suite stays under 15 minutes, and
# tests/runtime/test_devices.py runs fragments packed there.
@pytest.mark.parametrize("streaming", [
    pytest.param(None, id="whole"),
    pytest.param(hj.Streaming(fragments=2), id="fragments", marks=pytest.mark.slow)])
def test_outer_layout_packed_runs_as_the_tree_and_resumes_bit_for_bit(tmp_path, monkeypatch,
                                                                     streaming):
  """``hj.simulated_runtime(outer_layout="packed")`` on CPU: the run ends within float32
  rounding's drift of the tree run, and a run stopped after 9 outer updates and resumed by the same call
  ends bit for bit as the uninterrupted packed run; a tree run's checkpoint resumes packed."""
  batches = [[b for b, _ in zip(tiny.regression_stream(i), range(200))] for i in range(3)]
  options = dict(method="heloco", inner_tx=optax.sgd(0.05), inner_steps=4,
                 budget=hj.Budget(steps=120), speeds=[1.0, 2.0, 3.0], streaming=streaming)
  run = lambda **more: hj.simulate(tiny.regression_loss, tiny.regression_params(), batches,
                                   **{**options, **more})
  packs = []
  monkeypatch.setattr(server, "_pack", lambda tree, pack=server._pack: packs.append(1) or pack(tree))
  as_tree = run(runtime=hj.simulated_runtime(outer_layout="tree"))  # "auto" packs on a GPU
  assert not packs
  packed = run(runtime=hj.simulated_runtime(outer_layout="packed"))
  # each server packed its θ once, and each applied Δ was packed once (no grace groups here)
  assert len(packs) == (streaming.fragments if streaming else 1) + packed.summary["outer_updates"]
  for a, b in zip(jax.tree.leaves(packed.params), jax.tree.leaves(as_tree.params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)  # measured: ≤ 9e-8 apart
  assert packed.history[-1]["train_loss"] == pytest.approx(as_tree.history[-1]["train_loss"],
                                                           rel=1e-4)

  def stop(row):
    if row["event"] == "arrival" and row["outer_updates"] == 9:
      raise KeyboardInterrupt
  for first, then in (("packed", packed), ("tree", None)):
    workdir = hj.Workdir(str(tmp_path / first), checkpoint_every=4)
    with pytest.raises(KeyboardInterrupt):
      run(runtime=hj.simulated_runtime(outer_layout=first), workdir=workdir, on_row=stop)
    resumed = run(runtime=hj.simulated_runtime(outer_layout="packed"), workdir=workdir)
    for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(packed.params)):
      if then is not None:
        np.testing.assert_array_equal(a, b)
      else:  # 9 updates in the tree's bits, the rest packed
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
