"""Fragments (ALGORITHMS.md, "Fragments"): the split, the per-fragment servers, Streaming
DiLoCo against a NumPy replica written from that section, and the asynchronous methods'
per-fragment staleness, bytes and clock."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import heloco_jax as hj
from heloco_jax.comm import compress, fragments
from heloco_jax.training import methods
from heloco_jax.training import server as server_lib

TREE = {"a": jnp.zeros(10), "b": {"c": jnp.zeros(100), "d": jnp.zeros(5)}, "e": jnp.zeros(50),
        "f": jnp.zeros(3)}  # leaves in order: a 10, b/c 100, b/d 5, e 50, f 3


@pytest.mark.parametrize("layout, num, assignment", [
    ("contiguous", 2, (0, 0, 1, 1, 1)),   # cut where the running total passes 1/2 of 168
    ("contiguous", 5, (0, 1, 2, 3, 4)),
    ("strided", 2, (0, 1, 0, 1, 0)),
    ("balanced", 2, (1, 0, 1, 1, 1)),     # 100 | 50 + 10 + 5 + 3
    ("balanced", 3, (2, 0, 2, 1, 2)),     # 100 | 50 | 10 + 5 + 3
    ("contiguous", 1, (0, 0, 0, 0, 0)),
])
def test_the_layouts_split_the_leaves_as_documented(layout, num, assignment):
  split = fragments.split(TREE, num, layout)
  assert split.assignment == assignment
  assert sum(split.sizes(TREE)) == 168


def test_a_function_layout_and_take_put_merge():
  split = fragments.split(TREE, 2, lambda path, leaf: int(path.startswith("b/")))
  assert split.assignment == (0, 1, 1, 0, 0)
  tree = jax.tree.map(lambda x: x + 1.0, TREE)
  part = split.take(tree, 1)
  assert part["a"] is None and part["b"]["c"] is tree["b"]["c"]
  merged = split.merge([split.take(tree, 0), part])
  assert jax.tree.all(jax.tree.map(lambda x, y: x is y, merged, tree))
  put = split.put(TREE, part, 1)
  assert put["b"]["d"] is tree["b"]["d"] and put["e"] is TREE["e"]


@pytest.mark.parametrize("num, layout, message", [
    (0, "contiguous", r"^fragments=0 is not allowed; allowed: an integer in \[1, 5\]"),
    (6, "contiguous", r"^fragments=6 is not allowed"),
    (2, "random", r"^fragment_layout='random' is not allowed"),
    (3, lambda path, leaf: 0, r"leaves fragment 1 of 3 empty"),
    (2, lambda path, leaf: 7, r"^fragment_layout gave 7 for leaf 'a'"),
])
def test_bad_splits_are_refused_in_one_line(num, layout, message):
  with pytest.raises(ValueError, match=message):
    fragments.split(TREE, num, layout)


@pytest.mark.parametrize("method", ["async_nesterov", "delayed_nesterov", "mla", "heloco",
                                    "cgad", "diloco"])
def test_pushing_every_fragment_of_a_delta_equals_pushing_it_whole(method):
  """Per-leaf outer rules: P fragment pushes of the same Δ (each its own τ) leave θ where one
  push of Δ does, update after update: bit for bit, but for HeLoCo's rotated blocks, which XLA
  compiles with other fusions in a program of other leaves (a few ulps; its branches are
  the same block for block), and CGAD's Adam division (an ulp)."""
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), TREE)
  tx = methods.get(method).make_outer(3, None)
  whole = server_lib.OuterServer(tx, params)
  split = fragments.split(params, 3, "balanced")
  parts = server_lib.FragmentServers(
      lambda tx, params, **kw: server_lib.OuterServer(tx, params, **kw), tx, params, split)
  for tau in (0, 2, 1, 3):
    delta = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32),
                         params)
    row = whole.update([tau], delta)[0]
    rows = [parts.fragment(p).update([tau], split.take(delta, p))[0] for p in range(3)]
    if method == "heloco":
      for branch in ("keep", "rotate", "shrink", "pass"):
        assert row[f"branch_count/{branch}"] == sum(r[f"branch_count/{branch}"] for r in rows)
      jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6),
                   parts.params, whole.params)
      continue
    if method == "cgad":  # Adam's m̂/(√v̂ + ε), fused per program: an ulp or two of η·1
      jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-8),
                   parts.params, whole.params)
      continue
    same = jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)),
                        parts.params, whole.params)
    assert jax.tree.all(same), (tau, same)


# ---------------------------------------------------------------------------------------------
# Streaming DiLoCo against NumPy
# ---------------------------------------------------------------------------------------------
K, H, P, LR, OUTER_LR, MU = 2, 4, 2, 0.05, 0.7, 0.9


def _loss(params, batch):
  x, y = batch
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _batches(worker, n):
  rng = np.random.default_rng(worker + 10)
  out = []
  for _ in range(n):
    x = rng.normal(size=(8, 3)).astype(np.float32)
    out.append((x, (x @ np.array([[1.0], [-2.0], [0.5]], np.float32) + worker)))
  return out


def _numpy_streaming(rounds, tau, alpha, away=()):
  """ALGORITHMS.md, "Fragments", for Streaming DiLoCo: every H/P SGD steps, fragment j mod P
  (b: 0, w: 1; contiguous) is all-reduced, θ_p takes a Nesterov step with its own momentum,
  and the workers' θ_p blends in τ steps later. ``away``: (worker, round) pairs in which the
  worker takes no part (FAILURES.md, "Synchronous methods"): its batches are drawn and go
  unused, its state stays, the mean is the others'; at the next round it takes part in it
  starts from θ."""
  theta = {"b": np.zeros(1, np.float64), "w": np.zeros((3, 1), np.float64)}
  momentum = {k: np.zeros_like(v) for k, v in theta.items()}
  local = [{k: v.copy() for k, v in theta.items()} for _ in range(K)]
  data = [_batches(i, rounds * H // P) for i in range(K)]
  frag = {0: "b", 1: "w"}
  steps, read = H // P, [0] * K

  def sgd(i, n):
    for _ in range(n):
      x, y = (np.asarray(a, np.float64) for a in data[i][read[i]])
      read[i] += 1
      r = x @ local[i]["w"] + local[i]["b"] - y
      local[i]["w"] -= LR * 2 * x.T @ r / r.size
      local[i]["b"] -= LR * 2 * r.sum(0) / r.size

  def land(name):
    for i in range(K):
      local[i][name] = alpha * theta[name] + (1 - alpha) * local[i][name]

  for j in range(1, rounds + 1):
    part = [i for i in range(K) if (i, j) not in away]
    for i in part:
      if j > 1 and (i, j - 1) in away:  # back: θ as a whole
        local[i] = {k: v.copy() for k, v in theta.items()}
    before = [{k: v.copy() for k, v in local[i].items()} for i in range(K)]
    if tau == 0 or j == 1:
      for i in range(K):
        sgd(i, steps)
    else:
      for i in range(K):
        sgd(i, tau)
      land(frag[(j - 1) % P])
      for i in range(K):
        sgd(i, steps - tau)
    for i in set(range(K)) - set(part):  # its steps are lost, its batches read
      local[i] = before[i]
    name = frag[j % P]
    delta = theta[name] - np.mean([local[i][name] for i in part], axis=0)
    momentum[name] = MU * momentum[name] + delta
    theta[name] = theta[name] - OUTER_LR * (delta + MU * momentum[name])
    if tau == 0:
      land(name)
  return theta


@pytest.mark.parametrize("tau, alpha", [(0, 1.0), (1, 0.5), (1, 1.0)])
def test_streaming_diloco_against_numpy(tau, alpha):
  rounds = 6
  result = hj.simulate(
      _loss, {"b": jnp.zeros(1), "w": jnp.zeros((3, 1))},
      [_batches(i, (rounds + 1) * H // P) for i in range(K)], method="diloco", inner_steps=H,
      speeds=[1.0, 1.0], budget=hj.Budget(steps=rounds * K * H // P),
      inner_tx=optax.with_extra_args_support(optax.sgd(LR)),
      outer_tx=optax.sgd(OUTER_LR, momentum=MU, nesterov=True),
      streaming=hj.Streaming(fragments=P, overlap_steps=tau, alpha=alpha))
  expected = _numpy_streaming(rounds, tau, alpha)
  for name in ("b", "w"):
    np.testing.assert_allclose(result.params[name], expected[name], rtol=2e-5, atol=1e-6)
  rows = [r for r in result.history if r["event"] == "train"]
  assert [r["fragment"] for r in rows] == [1, 0, 1, 0, 1, 0]
  assert result.summary["outer_updates"] == rounds


@pytest.mark.parametrize("tau", [0, 1])
def test_streaming_diloco_with_a_worker_away_against_numpy(tau):
  """FAILURES.md, "Synchronous methods" with fragments: rounds of 2 s; worker 1 leaves at 3 s
  (round 2: its part is lost, dropped) and is back at 7 s (round 5: it starts from θ as a
  whole, as the NumPy reference does)."""
  rounds = 6
  result = hj.simulate(
      _loss, {"b": jnp.zeros(1), "w": jnp.zeros((3, 1))},
      [_batches(i, (rounds + 1) * H // P) for i in range(K)], method="diloco", inner_steps=H,
      speeds=[1.0, 1.0], budget=hj.Budget(steps=18),
      inner_tx=optax.with_extra_args_support(optax.sgd(LR)),
      outer_tx=optax.sgd(OUTER_LR, momentum=MU, nesterov=True),
      streaming=hj.Streaming(fragments=P, overlap_steps=tau),
      membership=hj.Membership(((1, 3.0, 7.0),)))
  expected = _numpy_streaming(rounds, tau, 1.0, away={(1, 2), (1, 3), (1, 4)})
  for name in ("b", "w"):
    np.testing.assert_allclose(result.params[name], expected[name], rtol=2e-5, atol=1e-6)
  # Not the run without the absence: the reference tells them apart.
  assert not np.allclose(_numpy_streaming(rounds, tau, 1.0)["w"], expected["w"], rtol=1e-3)
  rows = [(r["event"], r["sim_time"], r.get("steps"), r.get("dropped_steps"))
          for r in result.history if r["event"] in ("train", "left", "joined")]
  assert rows == [("train", 2.0, 4, None), ("left", 3.0, None, 2), ("train", 4.0, 6, None),
                  ("train", 6.0, 8, None), ("joined", 7.0, None, None),
                  ("train", 8.0, 10, None), ("train", 10.0, 14, None),
                  ("train", 12.0, 18, None)]
  assert result.summary["dropped_steps"] == 2 and result.summary["outer_updates"] == rounds


def test_a_streaming_round_every_worker_leaves_applies_nothing_and_the_run_goes_on():
  """Both workers leave during round 2: no update, its row has no training loss; everyone
  away until 5 s, then worker 1 alone (back from θ whole), then both."""
  result = hj.simulate(
      _loss, {"b": jnp.zeros(1), "w": jnp.zeros((3, 1))}, [_batches(i, 40) for i in range(K)],
      method="diloco", inner_steps=H, speeds=[1.0, 1.0], budget=hj.Budget(steps=12),
      inner_tx=optax.sgd(LR), streaming=hj.Streaming(fragments=P, overlap_steps=1),
      membership=hj.Membership(((0, 3.0, 7.0), (1, 3.5, 5.0))))
  trains = [(r["sim_time"], r["steps"], r["outer_updates"], "train_loss" not in r)
            for r in result.history if r["event"] == "train"]
  assert trains == [(2.0, 4, 1, False), (4.0, 4, 1, True), (7.0, 6, 2, False),
                    (9.0, 10, 3, False)]
  assert result.summary["dropped_steps"] == 4


def test_a_streaming_run_that_ends_on_its_budget_keeps_the_workers_states():
  """The budget is checked before a round, which donates the workers' states to its program
  (vmapped rounds: the default on accelerators). Before: a run that ended there left
  ``engine.state.workers`` deleted ("Array has been deleted" on a later read)."""
  import asyncio  # pylint: disable=g-import-not-at-top
  engine = hj.make_engine(
      _loss, {"b": jnp.zeros(1), "w": jnp.zeros((3, 1))}, [_batches(i, 40) for i in range(K)],
      method="diloco", inner_steps=H, speeds=[1.0, 1.0], budget=hj.Budget(steps=5 * K * H // P),
      inner_tx=optax.sgd(LR), streaming=hj.Streaming(fragments=P, overlap_steps=1),
      runtime=hj.simulated_runtime(worker_batching="vmap"))
  try:
    summary = asyncio.run(engine.run())
    assert summary["outer_updates"] == 5
    assert not any(x.is_deleted() for x in jax.tree.leaves(engine.state.workers))
    assert engine.state.workers.step.tolist() == [5 * H // P] * K
  finally:
    engine.close()


# ---------------------------------------------------------------------------------------------
# asynchronous methods with fragments
# ---------------------------------------------------------------------------------------------
def _stream(worker):
  rng = np.random.default_rng(worker)
  while True:
    x = rng.normal(size=(16, 8)).astype(np.float32)
    yield x, np.sin(x.sum(1, keepdims=True)) + worker


PARAMS = {"w1": jnp.full((8, 16), 0.1), "w2": jnp.full((16, 1), 0.1), "b": jnp.zeros((1,))}


def _mlp(params, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] + params["b"] - y) ** 2)


def _run_async(method="heloco", **options):
  options = {"inner_steps": 6, "budget": hj.Budget(steps=600), "speeds": [1.0, 2.0, 5.0],
             "streaming": hj.Streaming(fragments=3, layout="strided"),
             "inner_tx": optax.with_extra_args_support(optax.adam(0.01)), **options}
  evaluation = next(_stream(1))  # the middle worker's offset
  return hj.simulate(_mlp, PARAMS, [_stream(i) for i in range(3)], method=method,
                     eval_fn=lambda p: _mlp(p, evaluation), **options)


@pytest.mark.parametrize("method", ["async_nesterov", "delayed_nesterov", "mla", "heloco",
                                    pytest.param("cgad", marks=pytest.mark.slow)])
def test_each_fragment_keeps_its_own_version_and_staleness(method):
  """A worker sends fragments 1, 2, 0, 1, ... (its j-th sync sends j mod P); an arrival's τ is
  the updates of its fragment since the worker last received that fragment (at its own
  previous arrival of it, or at its first dispatch), recounted here from the rows."""
  # CGAD's Adam step at its default η = 1e-3 ends at 0.903× the initial loss here, at 2e-2 at
  # 0.797×: room below the bar.
  result = _run_async(method, **({"method_options": {"learning_rate": 2e-2}}
                                 if method == "cgad" else {}))
  arrivals = [r for r in result.history if r["event"] == "arrival"]
  assert result.summary["outer_updates"] == len(arrivals) > 30
  updates = [0] * 3
  received = {}  # (worker, fragment) -> updates of the fragment when the worker received it
  sent = {w: 0 for w in range(3)}
  for row in arrivals:
    w, p = row["worker"], row["fragment"]
    sent[w] += 1
    assert p == sent[w] % 3
    assert row["staleness"] == updates[p] - received.get((w, p), 0)
    updates[p] += 1
    received[(w, p)] = updates[p]
  learned = 0.9 if method == "cgad" else 0.8
  assert result.summary["final_val_loss"] < learned * result.summary["initial_val_loss"]


def test_fragment_bytes_and_the_overlapped_clock():
  comm = hj.CommModel(latency=0.5, bandwidth=64.0)
  result = _run_async(comm=comm, streaming=hj.Streaming(fragments=3, layout="strided",
                                                        overlap_steps=1, alpha=0.5))
  split = fragments.split(PARAMS, 3, "strided")  # b | w1 | w2 (leaves: b, w1, w2)
  sizes = [4 * n for n in split.sizes(PARAMS)]
  arrivals = [r for r in result.history if r["event"] == "arrival"]
  first = {}
  for row in arrivals:
    assert row["bytes_up"] == sizes[row["fragment"]]
    whole = row["worker"] not in first
    first.setdefault(row["worker"], row)
    # θ at a first dispatch, else the fragment it sent before
    assert row["bytes_down"] == (sum(sizes) if whole else sizes[(row["fragment"] - 1) % 3])
  # Worker 0's first fragment (1: w1) after θ's download, 2 steps of 1 s, its upload.
  assert first[0]["sim_time"] == 0.5 + sum(sizes) / 64.0 + 2.0 + 0.5 + sizes[1] / 64.0
  assert result.summary["bytes_sent"] == sum(r["bytes_up"] + r["bytes_down"] for r in arrivals)
  # θ whole each way: P times the fragments' peak
  plain = _run_async(comm=comm, streaming=hj.Streaming(fragments=1, layout="strided"))
  assert plain.summary["peak_bytes_per_sync"] == 2 * sum(sizes)


def test_fragments_with_error_feedback_compress_each_fragment():
  compressor = compress.error_feedback(compress.int8(block=32))
  result = _run_async(compress=compressor)
  split = fragments.split(PARAMS, 3, "strided")
  payload = [compress.payload_nbytes(compressor, split.take(PARAMS, p)) for p in range(3)]
  assert {(r["fragment"], r["bytes_up"]) for r in result.history
          if r["event"] == "arrival"} == set(enumerate(payload))
  assert result.summary["final_val_loss"] < 0.8 * result.summary["initial_val_loss"]


@pytest.mark.parametrize("options, message", [
    ({"streaming": hj.Streaming(fragments=2, layout="strided"), "inner_steps": 5},
     r"^streaming\.fragments=2 is not allowed; allowed: a divisor of inner_steps=5"),
    ({"streaming": hj.Streaming(fragments=4, layout="strided")},
     r"^streaming\.fragments=4 is not allowed; allowed: an integer in \[1, 3\] \(θ has 3 "),
    ({"streaming": hj.Streaming(fragments=3, layout="strided", overlap_steps=2)},
     r"^streaming\.overlap_steps=2 is not allowed; allowed: an integer in \[0, 2\)"),
    ({"streaming": hj.Streaming(fragments=3, layout="strided", alpha=0.0)},
     r"^streaming\.alpha=0.0 is not allowed"),
    ({"streaming": hj.Streaming(fragments=1, layout="strided", overlap_steps=1)},
     r"^streaming\.overlap_steps=1 is not allowed; allowed: 0 with "),
    ({"reset_optimizer": True}, r"^reset_optimizer=True is not allowed"),
    ({"syncer": hj.Syncer(grace_window=1.0)}, r"^syncer\.grace_window=1.0 is not allowed"),
    ({"method": "palsgd", "inner_tx": None},
     r"^streaming\.fragments=3 is not allowed; allowed: 1 with method='palsgd'"),
])
def test_fragment_settings_a_run_cannot_take_are_refused_in_one_line(options, message):
  options = dict(options)
  with pytest.raises(ValueError, match=message):
    _run_async(options.pop("method", "heloco"), **options)
