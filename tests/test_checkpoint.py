"""Checkpoints: packing, orbax round trips, fallback past corrupt steps, failed writes, and
exact resume of every method from a mid-run checkpoint (in-process)."""

import asyncio
import errno
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from heloco_jax import checkpoint, harness as scheduler, inner

import tiny


def _tree():
  return {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4) / 7,
          "b": jnp.ones((5,), jnp.bfloat16) * 1.5,
          "state": inner.InnerState(jnp.zeros((2,)), (), jnp.int32(7)),
          "none": None,
          "key": jax.random.key_data(jax.random.key(3))}


def _equal(a, b):
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  return (jax.tree.structure(a) == jax.tree.structure(b)
          and all(x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
                  for x, y in zip(leaves_a, leaves_b)))


def test_pack_unpack_round_trip_keeps_structure_dtypes_and_bits():
  tree = _tree()
  packed, layout = checkpoint.pack(tree)
  assert sorted(packed) == ["bfloat16", "float32", "int32", "uint32"]  # one array per dtype
  assert _equal(checkpoint.unpack(packed, layout, tree), tree)
  assert isinstance(checkpoint.unpack(packed, layout, tree)["state"], inner.InnerState)


def test_unpack_detects_a_changed_byte_and_a_different_structure():
  tree = _tree()
  packed, layout = checkpoint.pack(tree)
  corrupt = dict(packed, float32=packed["float32"].copy())
  corrupt["float32"][3] += 1.0
  with pytest.raises(ValueError, match="float32 arrays fail their checksum"):
    checkpoint.unpack(corrupt, layout, tree)
  other = dict(tree, w=jnp.zeros((4, 3)))
  with pytest.raises(ValueError, match="another structure or other shapes"):
    checkpoint.unpack(packed, layout, other)


def test_checkpointer_keeps_the_newest_and_restores_the_latest(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path / "c"), keep=2)
  for step in (1, 2, 3):
    ckpt.save(step, jax.tree.map(lambda x: x * step if x.dtype != jnp.uint32 else x, _tree()),
              {"step": step, "big": 2**100, "time": 0.1 + step})
  assert ckpt.steps() == [2, 3]
  step, arrays, meta = ckpt.restore(lambda meta: _tree())
  assert step == 3 and meta == {"step": 3, "big": 2**100, "time": 3.1}
  assert np.array_equal(arrays["w"], _tree()["w"] * 3)
  assert checkpoint.Checkpointer(str(tmp_path / "empty")).restore(lambda meta: _tree()) is None


def _largest_file(directory):
  files = [os.path.join(root, f) for root, _, names in os.walk(directory) for f in names]
  return max(files, key=os.path.getsize)


@tiny.ORBAX_CLOSED_LOOP_AFTER_A_FAILED_READ
def test_truncated_latest_checkpoint_falls_back_to_the_previous_with_a_warning(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path / "c"), keep=3)
  for step in (1, 2):
    ckpt.save(step, _tree(), {"step": step})
  victim = _largest_file(tmp_path / "c" / "2" / "arrays")
  with open(victim, "r+b") as f:
    f.truncate(os.path.getsize(victim) // 2)
  with pytest.warns(checkpoint.CheckpointFallbackWarning,
                    match="checkpoint 2: .*resuming from checkpoint 1 instead"):
    step, arrays, meta = ckpt.restore(lambda meta: _tree())
  assert step == 1 and meta == {"step": 1} and _equal(arrays, _tree())


def test_missing_metadata_and_half_written_steps_are_skipped(tmp_path):
  directory = tmp_path / "c"
  ckpt = checkpoint.Checkpointer(str(directory), keep=3)
  for step in (1, 2):
    ckpt.save(step, _tree(), {"step": step})
  os.remove(_largest_file(directory / "2" / "meta"))
  os.makedirs(directory / "3.orbax-checkpoint-tmp-123")  # a save killed half way
  with pytest.warns(checkpoint.CheckpointFallbackWarning):
    step, _, _ = checkpoint.Checkpointer(str(directory)).restore(lambda meta: _tree())
  assert step == 1


def test_no_readable_checkpoint_is_an_error_not_a_silent_restart(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path / "c"))
  ckpt.save(1, _tree(), {})
  with pytest.raises(checkpoint.CheckpointError,
                     match="no readable checkpoint.*another config.*new workdir"):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      ckpt.restore(lambda meta: dict(_tree(), w=jnp.zeros(2)))


def test_a_failed_save_says_why_and_keeps_the_earlier_checkpoint(tmp_path, monkeypatch):
  ckpt = checkpoint.Checkpointer(str(tmp_path / "c"))
  ckpt.save(1, _tree(), {"step": 1})

  def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  monkeypatch.setattr(ckpt._manager, "save", full_disk)
  with pytest.raises(checkpoint.CheckpointError,
                     match="could not write checkpoint 2 .*No space left on device; "
                           "checkpoint 1 is intact"):
    ckpt.save(2, _tree(), {"step": 2})
  monkeypatch.undo()
  assert ckpt.steps() == [1]
  assert ckpt.restore(lambda meta: _tree())[2] == {"step": 1}


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_an_unwritable_directory_fails_clearly_and_keeps_what_is_there(tmp_path):
  directory = tmp_path / "c"
  ckpt = checkpoint.Checkpointer(str(directory))
  ckpt.save(1, _tree(), {"step": 1})
  os.chmod(directory, 0o500)
  try:
    with pytest.raises(checkpoint.CheckpointError, match="checkpoint 1 is intact"):
      ckpt.save(2, _tree(), {"step": 2})
  finally:
    os.chmod(directory, 0o700)
  assert checkpoint.Checkpointer(str(directory)).restore(lambda meta: _tree())[0] == 1


def test_keep_must_be_a_positive_integer(tmp_path):
  with pytest.raises(ValueError, match="keep=0 is not allowed; allowed: an integer >= 1"):
    checkpoint.Checkpointer(str(tmp_path), keep=0)


# ------------------------------------------------------------------ exact resume, every method

_dataset = tiny.dataset


def _config(method, **overrides):
  """Token budget, evals, checkpoints every 2 updates, severe speeds with jitter (which
  exercises the clock's generator state)."""
  return tiny.config(method, **{"budget.tokens": 5_000, "eval_every_tokens": 700,
                                "checkpoint_every": 2, "speeds": "severe", "jitter": 0.3,
                                **overrides})


def _run(config, ckpt, restore_step=None):
  """(summary without wall-clock fields, rows, {step: rows emitted by then})."""
  simulation = scheduler.Simulation(config, _dataset(config.num_workers))
  if restore_step is not None:
    _, arrays, meta = ckpt.restore(simulation.state_template, step=restore_step)
    simulation.load_state(arrays, meta)
  rows_at = {}

  def on_checkpoint(sim):
    arrays, meta = sim.checkpoint_state()
    rows_at[sim.version] = len(sim.rows)
    ckpt.save(sim.version, arrays, meta)
  summary = asyncio.run(simulation.run(on_checkpoint=on_checkpoint))
  for key in ("wall_seconds", "tokens_per_second"):
    summary.pop(key)
  return summary, simulation.rows, rows_at


@pytest.mark.parametrize("method,overrides", [
    ("heloco", {}),
    ("heloco", {"grace_window": 3.0, "dylu": True}),
    ("mla", {}),
    ("async_nesterov", {"outer.weighting": "polynomial"}),
    ("delayed_nesterov", {}),
    ("diloco", {}),
    ("local_sgd", {}),
    ("palsgd", {"palsgd_warmup_steps": 6}),  # checkpoints inside the DDP warm-up too
    ("ddp", {}),
])
def test_resuming_any_checkpoint_reproduces_the_uninterrupted_run_bit_for_bit(
    tmp_path, method, overrides):
  config = _config(method, **overrides)
  ckpt = checkpoint.Checkpointer(str(tmp_path / "c"), keep=100)
  summary, rows, rows_at = _run(config, ckpt)
  steps = ckpt.steps()
  assert len(steps) >= 4, steps
  # One half way (for PALSGD also the first, in the warm-up, to cover both phases).
  phases = set()
  for step in ([steps[0]] if method == "palsgd" else []) + [steps[len(steps) // 2]]:
    resumed = scheduler.Simulation(config, _dataset(config.num_workers))
    _, arrays, meta = ckpt.restore(resumed.state_template, step=step)
    phases.add(meta["phase"])
    resumed_summary, resumed_rows, _ = _run(config, ckpt, restore_step=step)
    assert resumed_summary == summary
    assert resumed_rows == rows[rows_at[step]:]
  if method == "palsgd":
    assert phases == {"ddp", "rounds"}


def test_a_checkpoint_from_another_model_is_refused(tmp_path):
  config = _config("mla")
  ckpt = checkpoint.Checkpointer(str(tmp_path / "c"), keep=100)
  _run(config, ckpt)
  bigger = scheduler.Simulation(_config("mla", **{"model.d_model": 64}), _dataset(3))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    with pytest.raises(checkpoint.CheckpointError, match="other shapes than this run's"):
      ckpt.restore(bigger.state_template)


def test_a_checkpoint_from_before_train_losses_were_kept_still_resumes(tmp_path):
  config = _config("heloco")
  ckpt = checkpoint.Checkpointer(str(tmp_path / "c"), keep=100)
  _, rows, rows_at = _run(config, ckpt)
  step = ckpt.steps()[len(ckpt.steps()) // 2]
  resumed = scheduler.Simulation(config, _dataset(config.num_workers))
  _, arrays, meta = ckpt.restore(resumed.state_template, step=step)
  assert all(isinstance(entry[4], float) for entry in meta["jobs"])
  meta["jobs"] = [entry[:4] for entry in meta["jobs"]]  # the layout before train losses
  resumed.load_state(arrays, meta)
  asyncio.run(resumed.run())
  without_loss = lambda rs: [{k: v for k, v in r.items() if k != "train_loss"} for r in rs]
  assert without_loss(resumed.rows) == without_loss(rows[rows_at[step]:])
  missing = [r for r in resumed.rows if r["event"] == "arrival" and "train_loss" not in r]
  assert 0 < len(missing) <= len(meta["jobs"])  # only the jobs in flight at the checkpoint
