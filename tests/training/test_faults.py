"""Faults: a pseudo-gradient with a NaN or Inf is rejected before the outer rule.

``faulty`` (tests/faults.py: a runtime whose executor the tests wrap) puts a
NaN or Inf into one element of a worker's n-th pseudo-gradient (async) or of
its end params in its n-th round (sync). The server must emit a ``rejected``
row, leave θ and the outer state untouched, not count an outer update or a
staleness, re-dispatch the worker with fresh AdamW moments (its step count
kept), still count the tokens, and keep training. Runs use the small model of
``tiny``, on the CLI's engine (``harness.engine_of_config``).
"""

import asyncio
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tiny
from faults import faulty

from heloco_jax.cli.configs.validation import validate
from heloco_jax.lm import harness
from heloco_jax.training import rejection

H, BATCH, CONTEXT = tiny.H, tiny.BATCH, tiny.CONTEXT
DISPATCH_TOKENS = H * BATCH * CONTEXT  # one worker's H inner steps
SPEEDS = [1.0, 1.5, 2.0]  # H = 2: workers arrive every 2, 3 and 4 simulated seconds


_dataset, _config = tiny.dataset, tiny.config


# ------------------------------------------------------------------ helpers

def _copy(tree):
  """A host copy of ``tree`` that later donations cannot touch."""
  return jax.tree.map(lambda x: np.array(x, copy=True), jax.device_get(tree))


def _adam(opt_state):
  """The ``ScaleByAdamState`` inside the inner AdamW chain's state."""
  found = [s for s in jax.tree.leaves(
      opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
           if isinstance(s, optax.ScaleByAdamState)]
  assert len(found) == 1
  return found[0]


def _momentum(outer_state):
  """m of an outer state: a ``momentum`` field, or optax's Nesterov trace."""
  if hasattr(outer_state, "momentum"):
    return outer_state.momentum
  found = [s for s in jax.tree.leaves(
      outer_state, is_leaf=lambda x: isinstance(x, optax.TraceState))
           if isinstance(s, optax.TraceState)]
  assert len(found) == 1
  return found[0].trace


def _identical(a, b) -> bool:
  """Bit-for-bit equality of two host pytrees (same structure, dtypes and bytes)."""
  leaves_a, tree_a = jax.tree.flatten(a)
  leaves_b, tree_b = jax.tree.flatten(b)
  return tree_a == tree_b and all(
      x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
      for x, y in zip(leaves_a, leaves_b))


def _all_finite(tree) -> bool:
  return all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(tree))


class _Traced:
  """A run whose rows each come with a snapshot of θ, the outer state and the workers.

  ``fault``: ``faulty``'s arguments (worker, arrival, value), or None for a clean run.
  """

  def __init__(self, config, dataset=None, fault=None):
    config.metrics_fetch_every = 1  # each row is handed on as it happens, with its snapshot
    validate(config)
    overrides = {} if fault is None else {"runtime": faulty(**fault)}
    self.sim, _ = harness.engine_of_config(config, dataset or _dataset(config.num_workers),
                                      **overrides)
    self.snapshots = []

    def on_row(row):
      sim = self.sim
      # state() runs the steps of work still deferred (lazy in-flight work), so a
      # worker's state is the one after its last dispatch.
      workers = None if sim.state.workers is None else sim.snapshot()[0]["workers"]
      self.snapshots.append({"params": _copy(sim.params), "outer_state": _copy(sim.outer_state),
                             "workers": _copy(workers)})

    try:
      self.summary = asyncio.run(self.sim.run(on_row))
    finally:
      self.sim.close()
    self.rows = self.sim.rows
    assert len(self.rows) == len(self.snapshots)

  def index(self, event):
    return [i for i, row in enumerate(self.rows) if row["event"] == event]


def _learned(summary, margin):
  assert np.isfinite(summary["initial_val_loss"]) and np.isfinite(summary["final_val_loss"])
  assert summary["final_val_loss"] < summary["initial_val_loss"] - margin, summary


# ------------------------------------------------------------- async methods

ASYNC_EVENTS = 18  # arrivals processed (applied or rejected) within the token budget


@functools.lru_cache(maxsize=None)
def _heloco_nan():
  # Worker 1 arrives at t = 3, 6, 9, ...; its 2nd arrival (t = 6) is poisoned.
  return _Traced(_config("heloco", 3, speeds=SPEEDS,
                        **{"budget.tokens": ASYNC_EVENTS * DISPATCH_TOKENS}),
                 fault=dict(worker=1, arrival=2, value="nan"))


def _check_async_rejection(run, reason):
  """The checks common to every async method (``run``: worker 1's 2nd arrival poisoned)."""
  rows, summary = run.rows, run.summary
  rejected = run.index("rejected")
  assert len(rejected) == 1
  r = rejected[0]
  row = rows[r]
  assert (row["worker"], row["reason"]) == (1, reason)
  arrivals = run.index("arrival")
  assert [rows[i]["worker"] for i in arrivals if i < r].count(1) == 1  # its 2nd arrival
  assert row["sim_time"] == 6.0 and row["staleness"] >= 0
  assert not any(rows[i]["worker"] == 1 and rows[i]["sim_time"] == 6.0 for i in arrivals)

  # No update: the version is that of the last arrival before it, and the next is +1.
  before = [i for i in arrivals if i < r]
  after = [i for i in arrivals if i > r]
  assert before and after
  assert row["outer_updates"] == rows[before[-1]]["outer_updates"]
  assert rows[after[0]]["outer_updates"] == row["outer_updates"] + 1

  # θ and the outer state (momentum included) are bit for bit what they were.
  previous, at = run.snapshots[r - 1], run.snapshots[r]
  assert _identical(at["params"], previous["params"])
  assert _identical(at["outer_state"], previous["outer_state"])
  assert _identical(_momentum(at["outer_state"]), _momentum(previous["outer_state"]))
  # (The comparison can fail: an applied arrival does change θ and the momentum.)
  assert not _identical(run.snapshots[after[0]]["params"], at["params"])
  assert not _identical(_momentum(run.snapshots[after[0]]["outer_state"]),
                        _momentum(at["outer_state"]))

  # Every arrival row is one outer update; the rejected one adds no staleness entry.
  assert len(arrivals) == summary["outer_updates"] == ASYNC_EVENTS - 1
  assert len(run.sim.state.staleness) == summary["outer_updates"]
  assert summary["mean_staleness"] == pytest.approx(
      np.mean([rows[i]["staleness"] for i in arrivals]))
  # Its compute was spent: the rejected dispatch's tokens count, and are reported apart.
  assert summary["tokens"] == ASYNC_EVENTS * DISPATCH_TOKENS
  assert (summary["applied_tokens"], summary["rejected_tokens"], summary["rejected"]) == (
      (ASYNC_EVENTS - 1) * DISPATCH_TOKENS, DISPATCH_TOKENS, 1)
  # Worker 1 was re-dispatched and arrives again.
  assert [rows[i]["worker"] for i in after].count(1) >= 2

  assert _all_finite(run.sim.params) and _all_finite(_momentum(run.sim.outer_state))


def test_heloco_rejects_a_nan_pseudo_gradient_and_keeps_learning():
  run = _heloco_nan()
  _check_async_rejection(run, "nan")
  _learned(run.summary, margin=1.0)  # measured: 5.55 → 3.65


def test_async_nesterov_rejects_inf_and_resets_the_workers_adam_moments():
  # reset_optimizer=0 keeps AdamW moments across dispatches, so a reset is visible.
  run = _Traced(_config("async_nesterov", 3, speeds=SPEEDS, **{
      "budget.tokens": ASYNC_EVENTS * DISPATCH_TOKENS, "inner.reset_optimizer": False}),
                fault=dict(worker=1, arrival=2, value="inf"))
  _check_async_rejection(run, "inf")
  _learned(run.summary, margin=0.3)  # measured: 5.55 → 4.76

  r = run.index("rejected")[0]
  # Just before: worker 1 has run 2 dispatches with its moments kept (4 Adam steps).
  before = run.snapshots[r - 1]["workers"][1]
  assert int(before.step) == 2 * H and int(_adam(before.opt_state).count) == 2 * H
  # At the next row it has been re-dispatched once from fresh moments, step count kept.
  after = run.snapshots[r + 1]["workers"][1]
  assert run.rows[r + 1]["event"] == "arrival" and run.rows[r + 1]["worker"] != 1
  assert int(after.step) == 3 * H
  assert int(_adam(after.opt_state).count) == H


def test_rows_before_the_fault_equal_those_of_a_clean_run():
  poisoned = _heloco_nan()
  r = poisoned.index("rejected")[0]
  # A clean run of the same config; a shorter budget only cuts what follows the fault.
  clean = _Traced(_config("heloco", 3, speeds=SPEEDS, **{
      "budget.tokens": (r + 2) * DISPATCH_TOKENS}))
  assert clean.index("rejected") == []
  assert clean.rows[:r] == poisoned.rows[:r]
  for i in range(r):
    assert _identical(clean.snapshots[i]["params"], poisoned.snapshots[i]["params"])
    assert _identical(clean.snapshots[i]["outer_state"], poisoned.snapshots[i]["outer_state"])
  # Where the poisoned run rejected, the clean run applied that same arrival.
  twin = clean.rows[r]
  assert twin["event"] == "arrival" and twin["worker"] == 1
  assert twin["sim_time"] == poisoned.rows[r]["sim_time"]
  assert twin["staleness"] == poisoned.rows[r]["staleness"]
  assert twin["outer_updates"] == poisoned.rows[r]["outer_updates"] + 1


def test_grace_window_applies_the_others_when_one_arrival_is_rejected():
  # All three arrive at t = 2 and form one group; worker 1's pseudo-gradient is bad.
  run = _Traced(_config("heloco", 3, speeds=[1.0, 1.0, 1.0],
                        **{"syncer.grace_window": 0.5, "budget.sim_seconds": 2.0}),
                fault=dict(worker=1, arrival=1, value="nan"))
  events = [(row["event"], row.get("worker"), row["outer_updates"]) for row in run.rows]
  assert events[1:-1] == [("rejected", 1, 0), ("arrival", 0, 1), ("arrival", 2, 1)]
  assert run.summary["outer_updates"] == 1
  assert run.summary["tokens"] == 3 * DISPATCH_TOKENS
  assert _all_finite(run.sim.params)
  assert not _identical(run.snapshots[-1]["params"], run.snapshots[0]["params"])


# --------------------------------------------------------------- sync rounds

ROUND_TOKENS = 3 * DISPATCH_TOKENS  # three workers' H steps


def test_diloco_round_applies_the_other_workers_mean():
  rounds = 4
  run = _Traced(_config("diloco", 3, **{"budget.eval_every_tokens": ROUND_TOKENS,
                        "budget.tokens": rounds * ROUND_TOKENS}),
                fault=dict(worker=2, arrival=3, value="nan"))
  rows, summary = run.rows, run.summary
  rejected = run.index("rejected")
  assert len(rejected) == 1
  r = rejected[0]
  assert {k: rows[r][k] for k in ("worker", "reason", "staleness", "outer_updates")} == {
      "worker": 2, "reason": "nan", "staleness": 0, "outer_updates": 2}  # in round 3
  # One eval row per round: the version still rises by one every round.
  evals = run.index("eval")
  assert [rows[i]["outer_updates"] for i in evals] == list(range(rounds + 1))
  assert summary["outer_updates"] == rounds
  assert summary["tokens"] == rounds * ROUND_TOKENS  # the rejected worker's tokens count
  assert summary["rejected_tokens"] == DISPATCH_TOKENS and summary["rejected"] == 1
  assert summary["mean_staleness"] == 0.0
  # The faulty round did move θ (the two others' mean), and θ stays finite.
  assert [rows[i]["event"] for i in range(r - 1, r + 3)] == ["eval", "rejected", "train", "eval"]
  round_2, round_3 = run.snapshots[r - 1], run.snapshots[r + 2]
  assert not _identical(round_2["params"], round_3["params"])
  assert _all_finite(round_3["params"]) and _all_finite(round_3["outer_state"])
  # Worker 2's AdamW moments are fresh after its rejection; its step count is kept.
  adam = _adam(round_3["workers"].opt_state)
  assert [int(c) for c in adam.count] == [H, H, 0]
  assert all(not np.any(m[2]) for m in jax.tree.leaves(adam.mu))
  assert all(np.any(m[0]) for m in jax.tree.leaves(adam.mu))
  assert [int(s) for s in round_3["workers"].step] == [3 * H] * 3
  assert _all_finite(run.sim.params)
  _learned(summary, margin=0.7)  # measured: 5.55 → 4.19


def test_local_sgd_round_is_the_mean_of_the_accepted_workers_only():
  run = _Traced(_config("local_sgd", 3, **{"budget.eval_every_tokens": ROUND_TOKENS,
                        "budget.tokens": 2 * ROUND_TOKENS}),
                fault=dict(worker=1, arrival=2, value="inf"))
  r = run.index("rejected")[0]
  assert (run.rows[r]["worker"], run.rows[r]["reason"], run.rows[r]["outer_updates"]) == (
      1, "inf", 1)
  evals = run.index("eval")
  assert [run.rows[i]["outer_updates"] for i in evals] == [0, 1, 2]
  # local_sgd: θ ← mean of the end params (sgd with rate 1 on θ − mean θ_i).
  first, second = run.snapshots[evals[1]], run.snapshots[evals[2]]
  for theta, ends in zip(jax.tree.leaves(first["params"]),
                         jax.tree.leaves(first["workers"].params)):
    np.testing.assert_allclose(theta, ends.mean(axis=0), rtol=1e-5, atol=1e-6)
  ends_leaves = jax.tree.leaves(second["workers"].params)
  assert not np.isfinite(ends_leaves[0][1]).all()  # worker 1's poisoned end params
  for theta, ends in zip(jax.tree.leaves(second["params"]), ends_leaves):
    np.testing.assert_allclose(theta, ends[[0, 2]].mean(axis=0), rtol=1e-5, atol=1e-6)
  # Both accepted workers count: θ is neither of them alone.
  leaf, ends = jax.tree.leaves(second["params"])[-1], ends_leaves[-1]
  assert not np.allclose(leaf, ends[0]) and not np.allclose(leaf, ends[2])
  assert _all_finite(run.sim.params)


def test_single_worker_diloco_skips_the_update_of_a_rejected_round():
  rounds = 4
  run = _Traced(_config("diloco", 1, **{"budget.eval_every_tokens": DISPATCH_TOKENS,
                        "budget.tokens": rounds * DISPATCH_TOKENS}),
                # worker 0's shard; shares the evaluator's program with the others
                dataset=_dataset(3), fault=dict(worker=0, arrival=2, value="nan"))
  rows = run.rows
  r = run.index("rejected")[0]
  assert (rows[r]["worker"], rows[r]["reason"], rows[r]["staleness"],
          rows[r]["outer_updates"]) == (0, "nan", 0, 1)
  evals = run.index("eval")
  # Round 2 (every worker rejected) makes no update; the run goes on after it.
  assert [rows[i]["outer_updates"] for i in evals] == [0, 1, 1, 2, 3]
  assert run.summary["outer_updates"] == rounds - 1
  assert run.summary["tokens"] == rounds * DISPATCH_TOKENS
  round_1, round_2 = run.snapshots[evals[1]], run.snapshots[evals[2]]
  assert evals[1] < r < evals[2]
  assert _identical(round_1["params"], round_2["params"])
  assert _identical(round_1["outer_state"], round_2["outer_state"])
  assert rows[evals[1]]["val_loss"] == rows[evals[2]]["val_loss"]
  assert not _identical(run.snapshots[evals[3]]["params"], round_2["params"])
  assert _all_finite(run.sim.params) and _all_finite(run.sim.outer_state)
  assert rows[evals[-1]]["val_loss"] < rows[evals[2]]["val_loss"]  # still learning
  _learned(run.summary, margin=0.4)  # measured: 5.55 → 4.71


def test_palsgd_rejects_a_fault_after_its_ddp_warmup():
  # An eval row after every round (PALSGD rounds read fewer tokens than H steps).
  run = _Traced(_config("palsgd", 3, **{"budget.eval_every_tokens": 1,
                        "budget.tokens": 5 * ROUND_TOKENS}),
                fault=dict(worker=0, arrival=1, value="nan"))
  rows = run.rows
  rejected = run.index("rejected")
  assert len(rejected) == 1
  r = rejected[0]
  # The warm-up is H DDP steps; the fault is in the first round after it.
  assert (rows[r]["worker"], rows[r]["reason"], rows[r]["staleness"],
          rows[r]["outer_updates"]) == (0, "nan", 0, H)
  after = run.snapshots[r + 2]  # the round's train row, then its eval row
  assert [rows[i]["event"] for i in (r + 1, r + 2)] == ["train", "eval"]
  assert rows[r + 2]["outer_updates"] == H + 1
  # Worker 0's moments are fresh (PALSGD otherwise keeps them); step counts are kept.
  adam = _adam(after["workers"].opt_state)
  assert int(adam.count[0]) == 0 and int(adam.count[1]) > 0
  assert [int(s) for s in after["workers"].step] == [2 * H] * 3
  assert _all_finite(run.sim.params) and _all_finite(run.sim.outer_state)
  _learned(run.summary, margin=0.8)  # measured: 5.55 → 3.62


# --------------------------------------------------------------- unit tests

def _tree():
  return {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones((4,))}


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_nonfinite_and_reasons_on_one_tree(value):
  tree = _tree()
  assert rejection.reasons(*rejection.nonfinite(tree)) == [None]
  bad = dict(tree, b=tree["b"].at[2].set(jnp.nan if value == "nan" else -jnp.inf))
  has_nan, has_inf = rejection.nonfinite(bad)
  assert (bool(has_nan), bool(has_inf)) == (value == "nan", value == "inf")
  assert rejection.reasons(has_nan, has_inf) == [value]
  # A NaN wins over an Inf.
  both = dict(bad, a=tree["a"].at[0, 0].set(jnp.inf if value == "nan" else jnp.nan))
  assert rejection.reasons(*rejection.nonfinite(both)) == ["nan"]


def test_nonfinite_per_worker_flags_only_the_poisoned_slice():
  k = 4
  stacked = jax.tree.map(lambda x: jnp.stack([x + i for i in range(k)]), _tree())
  assert rejection.reasons(*rejection.nonfinite(stacked, per_worker=True)) == [None] * k
  poisoned = rejection.poison(stacked, "inf", worker=2)
  assert rejection.reasons(*rejection.nonfinite(poisoned, per_worker=True)) == [
      None, None, "inf", None]
  both = rejection.poison(poisoned, "nan", worker=0)
  assert rejection.reasons(*rejection.nonfinite(both, per_worker=True)) == [
      "nan", None, "inf", None]
  # Without per_worker the whole tree is one pseudo-gradient.
  assert rejection.reasons(*rejection.nonfinite(both)) == ["nan"]


def test_poison_changes_one_element_of_one_slice():
  k = 3
  stacked = jax.tree.map(lambda x: jnp.stack([x + i for i in range(k)]), _tree())
  for i in range(k):
    poisoned = rejection.poison(stacked, "nan", worker=i)
    a, b = np.asarray(poisoned["a"]), np.asarray(poisoned["b"])
    expected = np.asarray(stacked["a"]).copy()
    expected[i, 0, 0] = np.nan
    np.testing.assert_array_equal(a, expected)  # NaNs compare equal here
    assert np.isnan(a).sum() == 1
    np.testing.assert_array_equal(b, np.asarray(stacked["b"]))
  assert np.isfinite(np.asarray(stacked["a"])).all()  # the input is left as it was
  single = rejection.poison(_tree(), "inf")
  assert np.isposinf(np.asarray(single["a"])[0, 0])
  assert np.isfinite(np.asarray(single["a"])).sum() == 5
  np.testing.assert_array_equal(single["b"], _tree()["b"])
