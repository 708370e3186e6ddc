"""Checkpoints: packing, orbax round trips, fallback past corrupt steps, failed writes, and
exact resume of every method from a mid-run checkpoint (in-process: the checkpoints of a
workdir run, restored into the CLI's engine, ``harness.engine_of_config``)."""

import asyncio
import errno
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny

from heloco_jax.lm import harness
from heloco_jax.rundir import checkpoint
from heloco_jax.training import inner


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
  ckpt.save(4, _tree(), {"step": 4})
  ckpt.drop_before(4)
  assert ckpt.steps() == [4] and sorted(os.listdir(tmp_path / "c")) == ["4"]
  assert ckpt.restore(lambda meta: _tree())[0] == 4


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
  """Token budget, evals, checkpoints every 2 updates (all kept), severe speeds with jitter
  (which exercises the clock's generator state)."""
  return tiny.config(method, **{"budget.tokens": 5_000, "budget.eval_every_tokens": 700,
                                "checkpoint.every": 2, "checkpoint.keep": 100,
                                "speeds": "severe", "jitter": 0.3, **overrides})


def _engine(config, workdir=None):
  """The CLI's engine of ``config`` (``harness.engine_of_config``) on the tiny data."""
  return harness.engine_of_config(config, _dataset(config.num_workers), workdir=workdir)[0]


def _checkpoints(workdir):
  return checkpoint.Checkpointer(str(workdir / "checkpoints"), keep=100)


def _finish(engine):
  """(summary without wall-clock fields, rows) of running ``engine`` to its end."""
  try:
    summary = asyncio.run(engine.run())
  finally:
    engine.close()
  for key in ("wall_seconds", "tokens_per_second"):
    summary.pop(key)
  return summary, engine.rows


def _run(config, workdir):
  """The uninterrupted run, checkpointing every 2 outer updates to ``workdir`` (all kept)."""
  return _finish(_engine(config, str(workdir)))


def _resume(config, workdir, step):
  """(summary, rows emitted after the checkpoint, its meta) of a run restored in-process from
  ``workdir``'s checkpoint ``step`` (an engine without a workdir: the rows are this part's)."""
  engine = _engine(config)
  ckpt = _checkpoints(workdir)
  try:
    _, arrays, meta = ckpt.restore(engine.template, step=step)
  finally:
    ckpt.close()
  engine.restore(arrays, meta)
  return (*_finish(engine), meta)


@pytest.mark.parametrize("method,overrides", [
    ("heloco", {}),
    ("heloco", {"syncer.grace_window": 3.0, "dylu": True}),
    ("mla", {}),
    ("async_nesterov", {"outer.weighting": "polynomial"}),
    ("delayed_nesterov", {}),
    ("diloco", {}),
    ("local_sgd", {}),
    ("palsgd", {"palsgd_warmup_steps": 6}),  # checkpoints inside the DDP warm-up too
    ("ddp", {}),
    # Fragments in flight with their error-feedback residuals, anchors and overlapped syncs
    # (test_resume.py's SIGKILL case of the same runs under -m slow).
    ("heloco", {"inner_steps": 4, "streaming.fragments": 2, "streaming.overlap_steps": 1,
                "streaming.alpha": 0.5, "compression.kind": "int4",
                "compression.error_feedback": True, "budget.tokens": 2_500}),
    # Workers leaving and joining: a worker away at a checkpoint, a new one joining after it
    # (worker 3 is away from the start; test_resume.py's SIGKILL case under -m slow).
    ("mla", {"num_workers": 4, "speeds": [1.0, 1.3, 1.7, 2.0],
             "chaos.schedule": "1@5-30,2@8,3@0-20,0@40-45"}),
    # Streaming DiLoCo's elastic rounds: the workers that missed a round (they take θ whole)
    ("diloco", {"num_workers": 4, "speeds": [1.0, 1.3, 1.7, 2.0], "streaming.fragments": 2,
                "chaos.schedule": "1@5-30,2@8,3@0-20,0@40-45"}),
])
def test_resuming_any_checkpoint_reproduces_the_uninterrupted_run_bit_for_bit(
    tmp_path, method, overrides):
  config = _config(method, **overrides)
  summary, rows = _run(config, tmp_path)
  ckpt = _checkpoints(tmp_path)
  steps = ckpt.steps()
  ckpt.close()
  assert len(steps) >= 4, steps
  # One half way (for PALSGD also the first, in the warm-up, to cover both phases).
  phases = set()
  for step in ([steps[0]] if method == "palsgd" else []) + [steps[len(steps) // 2]]:
    resumed_summary, resumed_rows, meta = _resume(config, tmp_path, step)
    phases.add(meta["phase"])
    assert resumed_summary == summary
    assert resumed_rows == rows[meta["metrics"]["rows"]:]
    if "chaos.schedule" in overrides:  # membership events after the checkpoint too
      assert {"left", "joined"} <= {row["event"] for row in resumed_rows}
  if method == "palsgd":
    assert phases == {"ddp", "rounds"}


def test_a_checkpoint_from_another_model_is_refused(tmp_path):
  _run(_config("mla"), tmp_path)
  bigger = _engine(_config("mla", **{"model.d_model": 64}))
  ckpt = _checkpoints(tmp_path)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    with pytest.raises(checkpoint.CheckpointError, match="other shapes than this run's"):
      ckpt.restore(bigger.template)
  ckpt.close()


def test_a_checkpoint_from_before_train_losses_were_kept_still_resumes(tmp_path):
  config = _config("heloco")
  _, rows = _run(config, tmp_path)
  ckpt = _checkpoints(tmp_path)
  step = ckpt.steps()[len(ckpt.steps()) // 2]
  resumed = _engine(config)
  _, arrays, meta = ckpt.restore(resumed.template, step=step)
  ckpt.close()
  assert all(isinstance(entry[4], float) for entry in meta["jobs"])
  meta["jobs"] = [entry[:4] for entry in meta["jobs"]]  # the layout before train losses
  resumed.restore(arrays, meta)
  _, resumed_rows = _finish(resumed)
  without_loss = lambda rs: [{k: v for k, v in r.items() if k != "train_loss"} for r in rs]
  assert without_loss(resumed_rows) == without_loss(rows[meta["metrics"]["rows"]:])
  missing = [r for r in resumed_rows if r["event"] == "arrival" and "train_loss" not in r]
  assert 0 < len(missing) <= len(meta["jobs"])  # only the jobs in flight at the checkpoint
