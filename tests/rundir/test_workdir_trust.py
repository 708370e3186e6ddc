"""Issue 38: a run never writes outside its workdir, and one process owns it whatever happens
to DIR/lock. Each victim is a file in tmp_path that a symlink in the workdir points to."""

import asyncio
import os

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tiny

import heloco_jax as hj
from heloco_jax.cli import plot
from heloco_jax.rundir import safe_files
from heloco_jax.rundir import workdir as workdir_lib

W = np.array([[1.0], [-2.0]], np.float32)
VICTIM_TEXT = "root:x:0:0:root:/root:/bin/bash\n" * 50


def _loss(params, batch):
  x, y = batch
  return jnp.mean((x @ params["w"] - y) ** 2)


class Stream:
  def __init__(self, worker):
    self.worker = worker

  def __iter__(self):
    rng = np.random.default_rng(self.worker)
    while True:
      x = rng.normal(0, 1, (4, 2)).astype(np.float32)
      yield x, x @ W


def _kwargs(**more):
  return dict(inner_tx=optax.sgd(0.05), inner_steps=2, speeds=[1.0, 2.0],
              budget=hj.Budget(steps=40, eval_every_steps=8),
              eval_fn=lambda p: _loss(p, (np.eye(2, dtype=np.float32), W)), **more)


def _workdir(path):
  return hj.Workdir(str(path), checkpoint_every=2)


def _simulate(workdir, **more):
  return hj.simulate(_loss, {"w": jnp.zeros((2, 1))}, [Stream(0), Stream(1)],
                     workdir=_workdir(workdir), **_kwargs(**more))


@pytest.fixture
def victim(tmp_path):
  path = tmp_path / "victim_passwd"
  path.write_text(VICTIM_TEXT)
  return path


@pytest.mark.parametrize("name", workdir_lib.RUN_FILES + ("checkpoints", "tensorboard"))
def test_a_link_where_a_run_file_belongs_is_refused_and_its_target_untouched(tmp_path, victim,
                                                                              name):
  run = tmp_path / "run"
  run.mkdir()
  target = victim if name in workdir_lib.RUN_FILES else tmp_path / "outside_dir"
  target.mkdir(exist_ok=True) if not target.exists() else None
  os.symlink(target, run / name)
  with pytest.raises(hj.WorkdirError, match=f"{name} is a symbolic link"):
    _simulate(run)
  assert victim.read_text() == VICTIM_TEXT
  if target.is_dir():
    assert not os.listdir(target)


def test_a_resume_with_metrics_jsonl_turned_into_a_link_leaves_the_target_whole(tmp_path, victim):
  run = tmp_path / "run"
  _interrupted(run)
  os.remove(run / "metrics.jsonl")
  os.symlink(victim, run / "metrics.jsonl")
  with pytest.raises(hj.WorkdirError, match="metrics.jsonl is a symbolic link"):
    _simulate(run)
  assert victim.read_text() == VICTIM_TEXT


def test_the_cli_refuses_a_workdir_seeded_with_links_to_every_file_it_writes(tmp_path, victim):
  from heloco_jax.cli import train  # pylint: disable=g-import-not-at-top
  run = tmp_path / "run"
  run.mkdir()
  for name in workdir_lib.RUN_FILES:
    os.symlink(victim, run / name)
  assert train.main([f"--workdir={run}", "--config.budget.tokens=20480"]) == 2
  assert victim.read_text() == VICTIM_TEXT


def test_plot_never_writes_through_a_link_in_its_out_folder(tmp_path, victim):
  run = tmp_path / "run"
  _simulate(run)
  out = tmp_path / "plots"
  out.mkdir()
  os.symlink(victim, out / "loss_vs_steps.png")  # an API run counts steps
  assert plot.main([str(run), "--out", str(out)]) == 2
  assert victim.read_text() == VICTIM_TEXT


def test_atomic_writes_replace_files_and_refuse_links(tmp_path, victim):
  path = tmp_path / "file.json"
  safe_files.write_atomic(str(path), "one")
  safe_files.write_atomic(str(path), "two")
  assert path.read_text() == "two" and os.listdir(tmp_path) == sorted(os.listdir(tmp_path))
  assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")] == []
  os.symlink(victim, tmp_path / "link.json")
  with pytest.raises(safe_files.LinkError):
    safe_files.write_atomic(str(tmp_path / "link.json"), "x")
  with pytest.raises(safe_files.LinkError):
    safe_files.open_append(str(tmp_path / "link.json"))
  with pytest.raises(safe_files.LinkError):
    safe_files.truncate(str(tmp_path / "link.json"), 0)
  assert victim.read_text() == VICTIM_TEXT


def test_one_owner_even_when_the_lock_file_is_deleted_or_replaced(tmp_path, victim):
  run = tmp_path / "run"
  first = hj.make_engine(_loss, {"w": jnp.zeros((2, 1))}, [Stream(0), Stream(1)],
                         workdir=_workdir(run), **_kwargs())
  try:
    os.remove(run / "lock")
    with pytest.raises(hj.WorkdirError, match="is in use by"):
      hj.make_engine(_loss, {"w": jnp.zeros((2, 1))}, [Stream(0), Stream(1)], workdir=_workdir(run),
                     **_kwargs())
    os.symlink(victim, run / "lock")
    with pytest.raises(hj.WorkdirError):
      hj.make_engine(_loss, {"w": jnp.zeros((2, 1))}, [Stream(0), Stream(1)], workdir=_workdir(run),
                     **_kwargs())
  finally:
    first.close()
  assert victim.read_text() == VICTIM_TEXT


def test_a_run_whose_workdir_was_replaced_stops_writing(tmp_path):
  run = tmp_path / "run"
  engine = hj.make_engine(_loss, {"w": jnp.zeros((2, 1))}, [Stream(0), Stream(1)],
                          workdir=_workdir(run), **_kwargs())
  os.rename(run, tmp_path / "moved")
  run.mkdir()
  try:
    with pytest.raises(hj.WorkdirError, match="was moved or replaced"):
      asyncio.run(engine.run())
  finally:
    engine.close()
  assert not os.path.exists(run / "summary.json") and os.listdir(run) == []


def _interrupted(run, **more):
  """A workdir holding a run stopped after its 10th row, with checkpoints."""
  engine = hj.make_engine(_loss, {"w": jnp.zeros((2, 1))}, [Stream(0), Stream(1)],
                          workdir=_workdir(run), **_kwargs(**more))
  tiny.stop_after_rows(engine, 10)


def _other_loss(params, batch):
  x, y = batch
  return jnp.mean(jnp.abs(x @ params["w"] - y))


class WideStream(Stream):
  def __iter__(self):
    rng = np.random.default_rng(self.worker)
    while True:
      x = rng.normal(0, 1, (6, 2)).astype(np.float32)
      yield x, x @ W


def test_a_workdir_refuses_another_loss_fn_or_other_data_naming_what_differs(tmp_path):
  run = tmp_path / "run"
  _interrupted(run)
  with pytest.raises(hj.WorkdirError, match=r"another config; differing keys: .*loss_fn"):
    hj.simulate(_other_loss, {"w": jnp.zeros((2, 1))}, [Stream(0), Stream(1)],
                workdir=_workdir(run), **_kwargs())
  with pytest.raises(hj.WorkdirError, match=r"differing keys: .*first_batches"):
    hj.simulate(_loss, {"w": jnp.zeros((2, 1))}, [WideStream(0), WideStream(1)],
                workdir=_workdir(run), **_kwargs())
  with pytest.raises(hj.WorkdirError, match=r"differing keys: .*outer_tx"):
    hj.simulate(_loss, {"w": jnp.zeros((2, 1))}, [Stream(0), Stream(1)], workdir=_workdir(run),
                **_kwargs(outer_tx=hj.heloco(0.5, 0.9, num_workers=2)))
  # The same run resumes, and an explicit override is possible.
  _simulate(run)


def test_another_runs_checkpoints_copied_in_are_refused_not_resumed(tmp_path):
  import shutil  # pylint: disable=g-import-not-at-top
  ours, theirs = tmp_path / "ours", tmp_path / "theirs"
  _interrupted(ours)
  _interrupted(theirs, seed=1)
  shutil.rmtree(ours / "checkpoints")
  shutil.copytree(theirs / "checkpoints", ours / "checkpoints")
  with pytest.raises(Exception, match="belongs to another run"):
    _simulate(ours)
  assert not os.path.exists(ours / "summary.json")


def test_a_checkpoint_whose_metadata_lost_its_checksum_is_not_trusted(tmp_path):
  import json  # pylint: disable=g-import-not-at-top
  run = tmp_path / "run"
  _interrupted(run)
  steps = sorted(int(n) for n in os.listdir(run / "checkpoints") if n.isdigit())
  meta = str(run / "checkpoints" / str(steps[-1]) / "meta" / "metadata")
  with open(meta) as f:
    data = json.load(f)
  del data["crc32"]
  data["units"] = 10 ** 6
  with open(meta, "w") as f:
    json.dump(data, f)
  with (pytest.warns(UserWarning, match=f"checkpoint {steps[-1]}: its metadata fails its checksum"),
        pytest.warns(UserWarning, match=f"resuming from checkpoint {steps[-2]} drops checkpoint "
                     f"{steps[-1]}")):
    resumed = _simulate(run)
  assert resumed.summary["steps"] <= 40


def _victim_dir(tmp_path):
  """A folder outside the run holding a metrics.jsonl of known bytes; (folder, its bytes)."""
  outside = tmp_path / "victim_dir"
  outside.mkdir()
  (outside / "metrics.jsonl").write_text('{"event": "eval", "val_loss": 1.0}\n' * 30)
  return outside, {name: (outside / name).read_bytes() for name in os.listdir(outside)}


@pytest.mark.parametrize("name", ["process_1", "checkpoints"])
def test_process_i_of_a_multiprocess_run_refuses_a_link_at_its_folders(tmp_path, monkeypatch,
                                                                       name):
  """Issue 61: DIR/process_1 (its own) or DIR/checkpoints (shared) a link to another folder;
  process 1 writes nothing there, nor makes its folder."""
  outside, before = _victim_dir(tmp_path)
  run = tmp_path / "run"
  run.mkdir()
  os.symlink(outside, run / name)
  monkeypatch.setattr(workdir_lib.jax, "process_index", lambda: 1)
  with pytest.raises(hj.WorkdirError, match=f"{name} is a symbolic link"):
    workdir_lib.RunDirectory(str(run), "{}", checkpoint_every=2, flag="workdir")
  assert {name: (outside / name).read_bytes() for name in os.listdir(outside)} == before
  assert name == "process_1" or not (run / "process_1").exists()


def test_the_tensorboard_writer_refuses_a_link_made_after_the_run_started(tmp_path):
  from heloco_jax.rundir import writers  # pylint: disable=g-import-not-at-top
  outside, before = _victim_dir(tmp_path)
  (outside / "events.out.tfevents.1.host").write_bytes(b"someone's events")
  before = {name: (outside / name).read_bytes() for name in os.listdir(outside)}
  run = tmp_path / "run"
  run.mkdir()
  os.symlink(outside, run / "tensorboard")
  with pytest.raises(safe_files.LinkError, match="tensorboard is a symbolic link"):
    writers.for_workdir(["jsonl", "tensorboard"], str(run))
  assert {name: (outside / name).read_bytes() for name in os.listdir(outside)} == before


def test_the_ray_token_this_library_makes_is_private(tmp_path, monkeypatch):
  from heloco_jax.runtime import ray as ray_runtime  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("HOME", str(tmp_path))
  for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
    monkeypatch.delenv(name, raising=False)
  ray_runtime._make_private_token()  # pylint: disable=protected-access
  token = tmp_path / ".ray" / "auth_token"
  assert oct(token.stat().st_mode & 0o777) == "0o600" and len(token.read_text()) == 64
  first = token.read_text()
  ray_runtime._make_private_token()  # pylint: disable=protected-access
  assert token.read_text() == first  # an existing token is left as it is
  token.unlink()
  victim = tmp_path / "victim"
  victim.write_text(VICTIM_TEXT)
  os.symlink(victim, token)  # a link where the token goes: never written through
  ray_runtime._make_private_token()  # pylint: disable=protected-access
  assert victim.read_text() == VICTIM_TEXT
