"""Memory by what is in flight (issue 79, item 4; docs/DESIGN.md, "Memory per worker"): a
pending asynchronous worker keeps its dispatch point, shared with the workers dispatched at the
same θ, and of its last end state only what its next dispatch reads (``InnerLoop.carry``). The
numbers stay the same bit for bit, and a checkpoint written before (whole end states) resumes.
The bytes are measured in ``python -m benchmarks.memory --pending 16,64,256``, not here."""

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import heloco_jax as hj
from heloco_jax.rundir import checkpoint
from heloco_jax.training import inner as inner_lib

K, H, WIDTH = 4, 3, 8


def _problem():
  params = {"w": jnp.linspace(-1.0, 1.0, WIDTH * WIDTH).reshape(WIDTH, WIDTH),
            "b": jnp.zeros(WIDTH)}

  def loss_fn(p, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) - y) ** 2)
  return params, loss_fn


class _Data:
  """Worker ``worker``'s endless (x, y) batches, re-iterable (a resumed run reads them anew)."""

  def __init__(self, worker):
    self.worker = worker

  def __iter__(self):
    rng = np.random.default_rng(self.worker)
    while True:
      x = rng.standard_normal((4, WIDTH)).astype(np.float32)
      yield x, np.roll(x, self.worker + 1, axis=1)


def _batches(n):
  data = iter(_Data(7))
  return jax.tree.map(lambda *xs: np.stack(xs), *[next(data) for _ in range(n)])


TXS = {
    "adamw (warm-up + cosine)": lambda: None,
    "inject_hyperparams(adam) with a schedule": lambda: optax.inject_hyperparams(optax.adam)(
        learning_rate=optax.linear_schedule(0.0, 0.05, 5)),
    "sgd with momentum": lambda: optax.sgd(0.05, momentum=0.9),
}


def _equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("reset", [True, False], ids=["fresh per dispatch", "kept"])
@pytest.mark.parametrize("tx", list(TXS))
def test_a_carry_starts_the_next_dispatch_as_the_whole_end_state_does(tx, reset):
  params, loss_fn = _problem()
  inner = inner_lib.InnerLoop(loss_fn, TXS[tx](), reset_optimizer=reset, loop="scan")
  end, _ = inner.run_jit(inner.start_jit(params, None), _batches(H), jax.random.key(0))
  end = jax.tree.map(jnp.array, end)
  kept = inner.carry(end)
  assert kept.params is None  # the next dispatch starts from θ's point, never its own
  theta_sized = [x for x in jax.tree.leaves(kept) if np.size(x) > 1]
  assert (theta_sized == []) == reset  # fresh moments: nothing of θ's size is kept
  start = jax.tree.map(lambda x: x + 0.5, params)  # where the next dispatch starts
  _equal(inner.start_jit(start, kept), inner.start_jit(start, end))
  # After a rejected Δ: fresh moments from the carry start as from the whole state.
  _equal(inner.start_jit(start, inner.fresh_moments(kept)),
         inner.start_jit(start, inner.fresh_moments(end)))
  if not reset:  # the moments really are kept (and the rejection's reset really resets)
    assert not inner_lib.only_schedule_counts(kept.opt_state)
    assert inner_lib.only_schedule_counts(inner.fresh_moments(kept).opt_state)
  assert inner.carry(kept) is kept


def _engine(**options):
  params, loss_fn = _problem()
  return hj.make_engine(loss_fn, params, [_Data(i) for i in range(K)], method="heloco",
                        inner_steps=H, speeds=[1.0, 1.3, 1.7, 2.2],
                        budget=hj.Budget(steps=14 * H), metrics_fetch_every=1, **options)


@pytest.mark.parametrize("reset", [True, False], ids=["fresh per dispatch", "kept"])
def test_pending_workers_share_their_dispatch_point_and_keep_only_their_carry(reset):
  engine = _engine(reset_optimizer=reset)
  seen = []

  def look(row):
    if row.get("event") != "arrival":
      return
    s = engine.state
    pending = [job for job in s.jobs.values() if job.work is not None]  # not computed yet
    seen.append((len(pending), len({id(job.work.args[2]) for job in pending})))
    for state in s.workers:
      if state is not None:
        assert state.params is None
        if reset:
          assert all(np.size(x) <= 1 for x in jax.tree.leaves(state))
  asyncio.run(engine.run(on_row=look))
  engine.close()
  # At the first arrival the K − 1 others, dispatched together at θ_0, hold one point.
  assert seen[0] == (K - 1, 1)
  assert len(seen) == 14


@pytest.mark.parametrize("whole_states", [False, True],
                         ids=["carried states", "a checkpoint of whole states (before)"])
def test_a_run_resumed_from_a_checkpoint_mid_flight_ends_bit_for_bit(
    whole_states, tmp_path, monkeypatch):
  uninterrupted = _engine()
  asyncio.run(uninterrupted.run())
  uninterrupted.close()

  if whole_states:  # what releases before the carry wrote: whole end states, no "carried"
    monkeypatch.setattr(inner_lib.InnerLoop, "carry", lambda self, state: state)
  first = _engine()
  saved = checkpoint.Checkpointer(str(tmp_path / "checkpoints"))

  def stop_at_the_fifth_arrival(row):
    if row.get("event") == "arrival" and row["outer_updates"] == 5:
      first.request_stop()  # at the next loop boundary
  with pytest.raises(hj.Stopped):
    asyncio.run(first.run(on_row=stop_at_the_fifth_arrival))
  arrays, meta = first.snapshot()
  if whole_states:
    assert first.state.workers[0].params is not None
    del meta["carried"]
  saved.save(5, arrays, meta)
  first.close()
  monkeypatch.undo()

  resumed = _engine()
  _, arrays, meta = saved.restore(resumed.template)
  resumed.restore(arrays, meta)
  assert any(state.params is not None for state in resumed.state.workers) == whole_states
  asyncio.run(resumed.run())
  resumed.close()
  assert resumed.version == uninterrupted.version == 14
  _equal(resumed.params, uninterrupted.params)


def test_pending_starts_wait_in_host_memory_with_the_same_bits():
  """``hj.simulated_runtime(pending_memory="pinned_host")``: every pending worker's start sits
  in host memory (one copy per outer update) and the run's numbers are the default's."""
  kinds = set()
  engine = _engine(runtime=hj.simulated_runtime(pending_memory="pinned_host"))

  def look(row):
    for job in engine.state.jobs.values():
      if job.work is not None:
        kinds.update(x.sharding.memory_kind for x in jax.tree.leaves(job.work.args[2]))
  asyncio.run(engine.run(on_row=look))
  engine.close()
  default = _engine()
  asyncio.run(default.run())
  default.close()
  assert kinds == {"pinned_host"}
  assert "pending starts in pinned_host" in engine.runtime.executor.describe()
  _equal(engine.params, default.params)
  assert engine.rows == default.rows
  with pytest.raises(ValueError) as error:
    hj.simulated_runtime(pending_memory="host")
  assert str(error.value) == ("pending_memory='host' is not allowed; allowed: one of "
                              "['device', 'pinned_host']")
  params, loss_fn = _problem()  # where no start waits, the option is refused, not ignored
  for options in ({"method": "diloco"}, {"streaming": hj.Streaming(fragments=2)}):
    with pytest.raises(ValueError) as error:
      hj.make_engine(loss_fn, params, [_Data(i) for i in range(K)], inner_steps=2,
                     budget=hj.Budget(steps=8),
                     runtime=hj.simulated_runtime(pending_memory="pinned_host"),
                     **{"method": "heloco", **options})
    assert str(error.value).startswith("pending_memory='pinned_host' is not allowed with")
    assert "\n" not in str(error.value)
