"""A run's state (heloco_jax/runtime/state.py; issue 58): the engine keeps its own counters in
``RunState``, each feature its own state in ``Features``; each round-trips through an orbax
checkpoint alone (``entry_of``, ``arrays_of``, ``load_entry``), and a checkpoint written
before the entries (one flat meta) still restores."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from heloco_jax.comm import downlink, syncer, uplink
from heloco_jax.rundir import checkpoint
from heloco_jax.runtime import state as state_lib
from heloco_jax.runtime import streaming
from heloco_jax.training import membership, rejection

# Each feature's state with every field away from its default: what a checkpoint must keep.
FILLED = {
    "rejection": rejection.RejectionState(
        rejected=3, rejected_units=120, rejected_in_a_row={"count": 2, "kinds": ["nan"],
                                                           "workers": [1, 4]}),
    "traffic": state_lib.Traffic(bytes_sent=123_456, peak_bytes_per_sync=4_096, network_seconds=2.5),
    "streaming": streaming.StreamingState(
        fragment_versions=[4, 3], syncs=[5, 0, 2], received=[[4, 3], None, [1, 1]],
        anchors=[{"w": jnp.arange(4.0)}, {"w": jnp.ones(4)}, {"w": jnp.zeros(4)}]),
    "syncer": syncer.SyncerState(mean_gap=0.75, last_arrival=31.5),
    "membership": membership.MembershipState(away={2: [40.0, "join", 0], 0: [12.5, "leave", 60]},
                                             dispatched_units=900, dropped_units=60),
    "compression": uplink.CompressionState(
        states=[[{"residual": jnp.full(3, 0.5)}], [{"residual": jnp.full(3, -1.0)}]]),
    "downlink": downlink.DownlinkState(
        held=[{"w": jnp.arange(4.0)}, {"w": jnp.full(4, -0.5)}], bytes_down=[16, 0]),
    "evaluation": state_lib.EvaluationState(
        initial_eval={"event": "eval", "val_loss": 5.5}, last_eval={"event": "eval",
                                                                    "val_loss": 2.25},
        next_eval=math.inf),
    "replay": state_lib.ReplayState(queued=[[1, 2], [3, 1]], held=[
        {"w": jnp.arange(4.0)}, {"w": jnp.ones(4)}, {"w": jnp.full(4, -2.0)}]),
}


def _equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _round_trip(state, tmp_path):
  """``state`` saved as the only entry of an orbax checkpoint (beside a θ: orbax writes no
  empty checkpoint, and a run's always holds θ), restored into a fresh one."""
  arrays = {"params": jnp.zeros(2), **state_lib.arrays_of(state)}
  directory = checkpoint.Checkpointer(str(tmp_path / "checkpoints"))
  directory.save(1, arrays, {"entry": state_lib.entry_of(state)})
  template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                          arrays)
  _, restored_arrays, meta = directory.restore(lambda meta: template)
  fresh = type(state)()
  state_lib.load_entry(fresh, meta["entry"], restored_arrays)
  return fresh


def test_the_engine_keeps_at_most_12_fields_and_no_hand_kept_list():
  fields = [f.name for f in dataclasses.fields(state_lib.RunState)]
  assert len(fields) <= 12, fields
  assert not hasattr(state_lib.RunState, "META")
  assert {f.name for f in dataclasses.fields(state_lib.Features)} == set(FILLED)


@pytest.mark.parametrize("name", sorted(FILLED))
def test_each_feature_round_trips_through_a_checkpoint_alone(name, tmp_path):
  state = FILLED[name]
  restored = _round_trip(state, tmp_path)
  for field in dataclasses.fields(state):
    _equal(getattr(restored, field.name), getattr(state, field.name))
  assert restored != type(state)() or state == type(state)()  # not the defaults


def test_the_engines_counters_round_trip_too(tmp_path):
  state = state_lib.RunState(units=640, sim_time=12.5, version=7, staleness=[0, 2, 1],
                             phase="async", ddp_remaining=None, next_checkpoint=10,
                             wall_before=3.25, workers=[{"w": jnp.ones(2)}, None])
  restored = _round_trip(dataclasses.replace(state, workers=[{"w": jnp.ones(2)}]), tmp_path)
  assert (restored.units, restored.sim_time, restored.version, restored.staleness,
          restored.phase, restored.next_checkpoint, restored.wall_before) == (
              640, 12.5, 7, [0, 2, 1], "async", 10, 3.25)
  _equal(restored.workers, [{"w": jnp.ones(2)}])
  assert "jobs" not in state_lib.entry_of(state)  # the engine writes its jobs' entries itself


def test_a_checkpoint_written_before_the_entries_restores_from_its_flat_meta():
  """Before issue 58 every field sat flat in the meta under the same name."""
  flat = {"units": 5, "rejected": 2, "rejected_units": 40, "rejected_in_a_row": 0,
          "bytes_sent": 10, "peak_bytes_per_sync": 5, "network_seconds": 0.5,
          "fragment_versions": [1], "syncs": [2, 3], "received": [[1], [1]],
          "mean_gap": 1.5, "last_arrival": 9.0, "away": {"1": [3.0, "join", 0]},
          "dispatched_units": 80, "dropped_units": 20, "initial_eval": {"val_loss": 4.0},
          "last_eval": {"val_loss": 3.0}, "next_eval": None}
  features = state_lib.Features()
  for name, feature in features.items():
    state_lib.load_entry(feature, flat, {})
  assert features.rejection == rejection.RejectionState(2, 40, {"count": 0, "kinds": [],
                                                                "workers": []})
  assert features.traffic == state_lib.Traffic(10, 5, 0.5)
  assert features.syncer == syncer.SyncerState(1.5, 9.0)
  assert features.membership.away == {1: [3.0, "join", 0]}  # JSON's string keys as workers
  assert features.streaming.syncs == [2, 3] and features.streaming.anchors is None
  assert features.evaluation.next_eval == math.inf and features.compression.states is None
