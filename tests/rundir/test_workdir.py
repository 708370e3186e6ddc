"""A run's directory (heloco_jax/rundir/workdir.py): one owner at a time, a damaged metrics tail
or checkpoint metadata falls back to an older checkpoint, standard JSON, one-line errors."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import tiny
from faults import faulty
from test_resume import BASE, TINY, train_main, _finished_then_reopened, _outputs, _steps

from heloco_jax.lm import harness
from heloco_jax.rundir import checkpoint
from heloco_jax.rundir import workdir as workdir_lib


def _one_line(err):
  """The error line that ends ``err`` (after the run's start line, if it got that far)."""
  lines = err.strip().splitlines()
  assert "Traceback" not in err and lines[-1].startswith("heloco-jax train: "), err
  assert len(lines) == 1 or lines[-2].startswith("heloco-jax train: "), err
  return lines[-1]


def test_a_second_owner_is_refused_and_a_dead_owners_lock_is_taken_over(tmp_path, capsys):
  args = [*BASE, "--config.budget.tokens=400000", "--config.checkpoint.every=2"]
  workdir = str(tmp_path / "run")
  lock = os.path.join(workdir, "lock")
  first = subprocess.Popen([sys.executable, "-m", "heloco_jax.cli.train", f"--workdir={workdir}",
                            *tiny.once(args)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  try:
    deadline = time.monotonic() + 300
    while not (_steps(workdir) and os.path.exists(lock) and os.path.getsize(lock)):
      assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
      time.sleep(0.05)
    owner = json.loads(open(lock).read())
    assert (owner["pid"], owner["host"]) == (first.pid, socket.gethostname())
    capsys.readouterr()
    assert train_main([f"--workdir={workdir}", *args]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"is in use by pid {first.pid} on host '{socket.gethostname()}'" in line
    assert first.poll() is None  # the owner runs on, untouched
  finally:
    first.send_signal(signal.SIGKILL)
    first.communicate()
  # The kernel dropped the dead owner's lock; its record is still there.
  assert json.loads(open(lock).read())["pid"] == first.pid
  shorter = [*BASE, "--config.checkpoint.every=2"]
  assert train_main([f"--workdir={workdir}", *shorter, "--allow_config_change"]) == 0
  err = capsys.readouterr().err
  assert f"warning: took over the lock of pid {first.pid}" in err
  assert open(lock).read() == ""  # released at the end


def test_the_lock_is_exclusive_within_one_process_too(tmp_path):
  first = workdir_lib.RunDirectory(str(tmp_path), "{}", checkpoint_every=0)
  with pytest.raises(workdir_lib.WorkdirError, match=f"in use by pid {os.getpid()}"):
    workdir_lib.RunDirectory(str(tmp_path), "{}", checkpoint_every=0)
  first.close()
  workdir_lib.RunDirectory(str(tmp_path), "{}", checkpoint_every=0).close()


def test_a_cut_metrics_tail_falls_back_to_the_newest_checkpoint_it_covers(tmp_path, capsys):
  workdir, reference = _finished_then_reopened(tmp_path, BASE)
  steps = _steps(workdir)
  metrics = os.path.join(workdir, "metrics.jsonl")
  with open(metrics, "rb") as f:
    lines = f.read().splitlines(keepends=True)
  meta = [json.load(open(os.path.join(workdir, "checkpoints", str(s), "meta", "metadata")))
          for s in steps]
  # A crash cut the file inside the newest checkpoint's rows: the one before still fits.
  cut = meta[-1]["metrics"]["bytes"] - len(lines[meta[-1]["metrics"]["rows"] - 1]) // 2
  assert meta[-2]["metrics"]["bytes"] < cut
  with open(metrics, "r+b") as f:
    f.truncate(cut)
  capsys.readouterr()
  assert train_main([f"--workdir={workdir}", *BASE]) == 0
  err = capsys.readouterr().err
  assert f"warning: checkpoint {steps[-1]}: metrics.jsonl holds {cut} bytes" in err
  assert (f"resuming from checkpoint {steps[-2]} drops checkpoint {steps[-1]} and the "
          f"{meta[-1]['metrics']['rows'] - 1 - meta[-2]['metrics']['rows']} rows") in err
  assert _outputs(workdir) == reference


def test_when_no_checkpoint_fits_the_metrics_the_error_is_one_line(tmp_path, capsys):
  workdir, _ = _finished_then_reopened(tmp_path, BASE)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.write('{"event": "eval"}\n')
  capsys.readouterr()
  assert train_main([f"--workdir={workdir}", *BASE]) == 2
  line = _one_line(capsys.readouterr().err)
  assert "no readable checkpoint" in line and "metrics.jsonl holds" in line


def test_edited_checkpoint_metadata_fails_its_checksum_and_falls_back(tmp_path, capsys):
  workdir, reference = _finished_then_reopened(tmp_path, BASE)
  steps = _steps(workdir)
  path = os.path.join(workdir, "checkpoints", str(steps[-1]), "meta", "metadata")
  with open(path) as f:
    meta = json.load(f)
  meta["units"] += 1  # e.g. "tokens": 58880 -> 58881
  with open(path, "w") as f:
    json.dump(meta, f)
  capsys.readouterr()
  assert train_main([f"--workdir={workdir}", *BASE]) == 0
  err = capsys.readouterr().err
  assert f"checkpoint {steps[-1]}: its metadata fails its checksum" in err
  assert f"resuming from checkpoint {steps[-2]}" in err
  assert _outputs(workdir) == reference


def test_a_full_disk_at_the_first_checkpoint_is_one_line(tmp_path, capsys, monkeypatch):
  def full(self, step, *args, **kwargs):  # tensorstore's error, as orbax raises it
    raise ValueError("RESOURCE_EXHAUSTED: Error writing local file \"/x/ocdbt.process_0/d/"
                     "abc\": [OS error 28: No space left on device]\nmore lines")
  monkeypatch.setattr(checkpoint.ocp.CheckpointManager, "save", full)
  workdir = str(tmp_path / "run")
  assert train_main([f"--workdir={workdir}", *BASE]) == 1
  line = _one_line(capsys.readouterr().err)
  assert f"could not write checkpoint 4 to {workdir}/checkpoints: No space left on device" in line
  assert line.endswith("there is no earlier checkpoint")


def test_metrics_jsonl_as_a_directory_is_named_as_such(tmp_path, capsys):
  workdir, _ = _finished_then_reopened(tmp_path, BASE)
  os.remove(os.path.join(workdir, "metrics.jsonl"))
  os.mkdir(os.path.join(workdir, "metrics.jsonl"))
  capsys.readouterr()
  assert train_main([f"--workdir={workdir}", *BASE]) == 2
  line = _one_line(capsys.readouterr().err)
  assert "metrics.jsonl is not a file" in line


def test_a_data_error_names_the_config_key_and_leaves_no_trace(tmp_path, capsys):
  workdir = tmp_path / "run"
  assert train_main([f"--workdir={workdir}", *BASE, "--config.data.languages=xx"]) == 2
  line = _one_line(capsys.readouterr().err)
  assert "config.data.languages=['xx'] is not allowed" in line and "make_data" not in line
  assert not workdir.exists()


def test_rows_and_summary_are_standard_json(tmp_path):
  row = {"event": "eval", "val_loss": float("nan"), "x": [float("inf"), 1.0], "y": {"z": -1e999}}
  assert workdir_lib.dumps(row) == ('{"event": "eval", "val_loss": null, "x": [null, 1.0], '
                                    '"y": {"z": null}}')
  directory = workdir_lib.RunDirectory(str(tmp_path), "{}", checkpoint_every=0)
  directory.restore(None)
  directory.write_row(row)
  directory.finish({"final_val_loss": float("nan")})
  directory.close()
  strict = {"parse_constant": lambda name: pytest.fail(f"non-standard JSON: {name}")}
  assert json.loads((tmp_path / "metrics.jsonl").read_text(), **strict)["val_loss"] is None
  assert json.loads((tmp_path / "summary.json").read_text(), **strict) == {
      "final_val_loss": None}


def test_arrivals_that_keep_being_rejected_stop_the_run_naming_workers_and_cause(
    tmp_path, capsys):
  workdir = tmp_path / "run"
  assert train_main([f"--workdir={workdir}", *TINY, "--config.budget.tokens=8000",
                     "--config.inner.learning_rate=1e30", "--config.inner.grad_clip=0",
                     "--config.rejection_limit=4", "--config.speeds=homogeneous"]) == 1
  line = _one_line(capsys.readouterr().err)
  assert "the last 4 pseudo-gradients (from workers 0, 1, 2)" in line
  assert "were non-finite (nan)" in line and "a lower inner learning rate" in line
  rows = [json.loads(r) for r in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["event"] for r in rows[-4:]] == ["rejected"] * 4
  assert not (workdir / "summary.json").exists()


def test_a_few_rejections_are_reported_apart_in_the_summary_and_final_line(
    tmp_path, capsys, monkeypatch):
  workdir = tmp_path / "run"
  # Worker 0's 2nd pseudo-gradient carries a NaN: the CLI's runtime wrapped by the tests'
  # fault-injecting executor (production code has no switch for it).
  runtime_factory = harness.runtime_factory
  monkeypatch.setattr(harness, "runtime_factory", lambda config: faulty(
      worker=0, arrival=2, runtime=runtime_factory(config)))
  assert train_main([f"--workdir={workdir}", *BASE]) == 0
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["rejected"] == 1 and summary["rejected_tokens"] == 2 * 4 * 16  # H·B·T
  assert summary["applied_tokens"] == summary["tokens"] - summary["rejected_tokens"]
  assert summary["rejected_by"] == {"nan": 1}
  assert (f"done: {summary['tokens']} tokens (128 of them rejected: 1 pseudo-gradient: "
          "nan 1)") in capsys.readouterr().err
