"""Kill and resume through the command line: SIGKILL a real run after its second checkpoint,
re-run the same command, get the uninterrupted run's files; config-mismatch refusal;
fallback past a corrupt checkpoint; write failures that keep the last good checkpoint."""

import errno
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import test_writers
import tiny

from heloco_jax.cli import train
from heloco_jax.rundir import checkpoint

train_main = lambda args: train.main(tiny.once(args))  # noqa: E731  (shared flags overridden)

TINY = ["--config.num_workers=3", "--config.model.d_model=32", "--config.model.num_layers=1",
        "--config.model.context=16", "--config.batch_size=4", "--config.inner_steps=2",
        "--config.data.max_bytes_per_language=40000", "--config.data.val_sequences_per_language=8",
        "--config.budget.eval_every_tokens=1000", "--config.inner.warmup_steps=2"]
WALL_CLOCK = ("wall_seconds", "tokens_per_second")


def _outputs(workdir):
  """(metrics.jsonl text, summary without its wall-clock fields)."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    metrics = f.read()
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = {k: v for k, v in json.load(f).items() if k not in WALL_CLOCK}
  return metrics, summary


def _steps(workdir):
  directory = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit()) if os.path.isdir(
      directory) else []


def _kill_after_second_checkpoint(args, workdir, timeout=300):
  """Starts `heloco-jax train` in a subprocess and SIGKILLs it once 2 checkpoints exist."""
  process = subprocess.Popen([sys.executable, "-m", "heloco_jax.cli.train", *tiny.once(args)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  deadline = time.monotonic() + timeout
  while len(_steps(workdir)) < 2 and process.poll() is None and time.monotonic() < deadline:
    time.sleep(0.02)
  process.send_signal(signal.SIGKILL)
  _, err = process.communicate()
  assert process.returncode == -signal.SIGKILL, (
      f"the run ended by itself before a second checkpoint: {err.decode()[-2000:]}")
  assert not os.path.exists(os.path.join(workdir, "summary.json"))
  return _steps(workdir)


@pytest.mark.parametrize("method,extra", [
    ("heloco", ["--config.speeds=severe", "--config.jitter=0.2", "--config.budget.tokens=8000",
                "--config.checkpoint.every=3"]),
    # (the default suite's time, < 15 min: test_checkpoint.py resumes these in-process)
    pytest.param("diloco", ["--config.speeds=mild", "--config.budget.tokens=12000",
                            "--config.checkpoint.every=2"], marks=pytest.mark.slow),
    pytest.param("palsgd", ["--config.speeds=mild", "--config.budget.tokens=12000",
                            "--config.checkpoint.every=2", "--config.palsgd_warmup_steps=4"],
                 marks=pytest.mark.slow),
    # Error-feedback residuals: in flight with the asynchronous work, stacked in rounds.
    pytest.param("heloco", ["--config.speeds=severe", "--config.jitter=0.2",
                            "--config.budget.tokens=8000", "--config.checkpoint.every=3",
                            "--config.compression.kind=int4",
                            "--config.compression.error_feedback=true"],
                 marks=pytest.mark.slow),
    pytest.param("diloco", ["--config.speeds=mild", "--config.budget.tokens=12000",
                            "--config.checkpoint.every=2", "--config.compression.kind=top_k",
                            "--config.compression.fraction=0.05",
                            "--config.compression.error_feedback=true"],
                 marks=pytest.mark.slow),
    # Fragments in flight with their residuals, anchors and overlapped syncs.
    pytest.param("heloco", ["--config.speeds=severe", "--config.jitter=0.2",
                            "--config.budget.tokens=8000", "--config.checkpoint.every=3",
                            "--config.inner_steps=4", "--config.streaming.fragments=2",
                            "--config.streaming.overlap_steps=1", "--config.streaming.alpha=0.5",
                            "--config.compression.kind=int4",
                            "--config.compression.error_feedback=true"],
                 marks=pytest.mark.slow),
    pytest.param("diloco", ["--config.speeds=mild", "--config.budget.tokens=12000",
                            "--config.checkpoint.every=2", "--config.inner_steps=4",
                            "--config.streaming.fragments=2",
                            "--config.streaming.overlap_steps=1",
                            "--config.streaming.alpha=0.5"], marks=pytest.mark.slow),
    # Workers leaving and joining (issue 35): a worker away at a checkpoint, a new one joining
    # after it (4 workers: worker 3 is away from the start; resumed in-process by
    # test_checkpoint.py in the default suite).
    pytest.param("mla", ["--config.num_workers=4", "--config.speeds=[1.0,1.3,1.7,2.0]",
                         "--config.budget.tokens=8000", "--config.checkpoint.every=3",
                         "--config.chaos.schedule=1@5-30,2@8,3@0-20,0@40-45"],
                 marks=pytest.mark.slow),
])
def test_sigkill_then_the_same_command_gives_the_uninterrupted_run(tmp_path, method, extra):
  args = [*TINY, f"--config.method={method}", *extra]
  reference = str(tmp_path / "reference")
  assert train_main([f"--workdir={reference}", *args]) == 0
  killed = str(tmp_path / "killed")
  steps = _kill_after_second_checkpoint([f"--workdir={killed}", *args], killed)
  assert len(steps) >= 2
  result = subprocess.run([sys.executable, "-m", "heloco_jax.cli.train", f"--workdir={killed}",
                           *tiny.once(args)], capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"resuming from checkpoint {steps[-1]}" in result.stderr
  metrics, summary = _outputs(killed)
  reference_metrics, reference_summary = _outputs(reference)
  assert summary == reference_summary
  assert metrics == reference_metrics  # no duplicated or missing rows
  # TensorBoard too: exactly the uninterrupted run's (tag, step, value) scalars (issue 38).
  scalars = test_writers.read_scalars(os.path.join(killed, "tensorboard"))
  reference_scalars = test_writers.read_scalars(os.path.join(reference, "tensorboard"))
  assert {tag: sorted(v) for tag, v in scalars.items()} == {
      tag: sorted(v) for tag, v in reference_scalars.items()}
  assert sum(map(len, scalars.values())) == sum(map(len, reference_scalars.values())) > 0


def _finished_then_reopened(tmp_path, args):
  """A run that finished, with summary.json removed: as if killed after its last checkpoint."""
  workdir = str(tmp_path / "run")
  assert train_main([f"--workdir={workdir}", *args]) == 0
  reference = _outputs(workdir)
  os.remove(os.path.join(workdir, "summary.json"))
  return workdir, reference


BASE = [*TINY, "--config.method=mla", "--config.budget.tokens=4000",
        "--config.checkpoint.every=4"]


def test_a_different_config_is_refused_naming_the_keys(tmp_path, capsys):
  workdir, _ = _finished_then_reopened(tmp_path, BASE)
  capsys.readouterr()
  assert train_main([f"--workdir={workdir}", *BASE, "--config.seed=1",
                     "--config.outer.momentum=0.8"]) == 2
  err = capsys.readouterr().err
  assert "holds a run with another config; differing keys: outer.momentum (0.9 -> 0.8), " \
         "seed (0 -> 1)." in err
  assert "--allow_config_change" in err
  assert not os.path.exists(os.path.join(workdir, "summary.json"))


def _drop_from_config(workdir, section, key):
  """config.json as an older heloco-jax wrote it: without ``section.key``."""
  path = os.path.join(workdir, "config.json")
  with open(path) as f:
    config = json.load(f)
  del config[section][key]
  with open(path, "w") as f:
    json.dump(config, f)


def test_a_key_added_since_the_run_began_resumes_at_its_default_and_matches(tmp_path, capsys):
  workdir, reference = _finished_then_reopened(tmp_path, BASE)
  _drop_from_config(workdir, "ray", "replacements")
  assert train_main([f"--workdir={workdir}", *BASE]) == 0
  assert _outputs(workdir) == reference
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["ray"]["replacements"] == 0  # the resumed config, key and all


def test_a_config_json_under_the_former_key_names_resumes_and_matches(tmp_path, capsys):
  """Keys renamed since (``schema.RENAMED``: e.g. ``checkpoint_every`` -> ``checkpoint.every``):
  a workdir whose config.json has the former names resumes to the uninterrupted run and
  is rewritten under the new ones; the former flag is refused in one line naming the new."""
  workdir, reference = _finished_then_reopened(tmp_path, BASE)
  path = os.path.join(workdir, "config.json")
  with open(path) as f:
    config = json.load(f)
  config["eval_every_tokens"] = config["budget"].pop("eval_every_tokens")
  config["grace_window"] = config["syncer"].pop("grace_window")
  checkpoint = config.pop("checkpoint")
  config["checkpoint_every"], config["keep_checkpoints"] = checkpoint["every"], checkpoint["keep"]
  with open(path, "w") as f:
    json.dump(config, f)
  capsys.readouterr()
  assert train_main([f"--workdir={workdir}", *BASE, "--config.budget.eval_every_tokens=2000"]) == 2
  assert "differing keys: budget.eval_every_tokens (1000 -> 2000)." in capsys.readouterr().err
  assert train_main([f"--workdir={workdir}", *BASE]) == 0
  assert _outputs(workdir) == reference
  with open(path) as f:
    assert json.load(f)["checkpoint"] == checkpoint
  capsys.readouterr()
  assert train_main([f"--workdir={tmp_path / 'new'}", "--config.checkpoint_every=2"]) == 2
  assert capsys.readouterr().err.startswith(
      "heloco-jax train: --config.checkpoint_every was renamed: --config.checkpoint.every\n")


def test_a_key_added_since_the_run_began_but_set_off_its_default_is_refused(tmp_path, capsys):
  workdir, _ = _finished_then_reopened(tmp_path, BASE)
  _drop_from_config(workdir, "ray", "replacements")
  capsys.readouterr()
  assert train_main([f"--workdir={workdir}", *BASE, "--config.ray.replacements=2"]) == 2
  assert "differing keys: ray.replacements (absent -> 2)." in capsys.readouterr().err


def test_allow_config_change_extends_the_budget_to_an_uninterrupted_longer_run(tmp_path):
  workdir, _ = _finished_then_reopened(tmp_path, BASE)
  longer = [*BASE, "--config.budget.tokens=6000"]
  assert train_main([f"--workdir={workdir}", *longer, "--allow_config_change"]) == 0
  reference = str(tmp_path / "longer")
  assert train_main([f"--workdir={reference}", *longer]) == 0
  assert _outputs(workdir) == _outputs(reference)
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["budget"]["tokens"] == 6000


@tiny.ORBAX_CLOSED_LOOP_AFTER_A_FAILED_READ
def test_a_corrupt_latest_checkpoint_falls_back_with_a_warning_and_still_matches(
    tmp_path, capsys):
  workdir, reference = _finished_then_reopened(tmp_path, BASE)
  steps = _steps(workdir)
  assert len(steps) == 3  # keep_checkpoints
  latest = os.path.join(workdir, "checkpoints", str(steps[-1]), "arrays")
  files = [os.path.join(root, f) for root, _, names in os.walk(latest) for f in names]
  victim = max(files, key=os.path.getsize)
  with open(victim, "r+b") as f:
    f.truncate(os.path.getsize(victim) // 3)
  capsys.readouterr()
  assert train_main([f"--workdir={workdir}", *BASE]) == 0
  err = capsys.readouterr().err
  assert f"warning: checkpoint {steps[-1]}: " in err
  assert f"resuming from checkpoint {steps[-2]} instead" in err
  assert _outputs(workdir) == reference


def test_a_finished_run_is_not_run_again(tmp_path, capsys):
  workdir = str(tmp_path / "run")
  assert train_main([f"--workdir={workdir}", *BASE]) == 0
  assert train_main([f"--workdir={workdir}", *BASE]) == 2
  assert "already holds a finished run" in capsys.readouterr().err


def test_an_unwritable_workdir_fails_before_any_work(tmp_path, capsys):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  assert train_main([f"--workdir={blocker}/run", *BASE]) == 2
  assert "is not writable: Not a directory" in capsys.readouterr().err
  if os.geteuid() != 0:  # root writes to read-only directories
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert train_main([f"--workdir={locked}/run", *BASE]) == 2
    assert "is not writable: Permission denied" in capsys.readouterr().err


def test_a_full_disk_mid_run_keeps_the_last_good_checkpoint_and_resumes(
    tmp_path, capsys, monkeypatch):
  reference = str(tmp_path / "reference")
  assert train_main([f"--workdir={reference}", *BASE]) == 0
  save = checkpoint.ocp.CheckpointManager.save
  calls = []

  def fails_the_second_time(self, step, *args, **kwargs):  # orbax meets a full disk
    calls.append(step)
    if len(calls) == 2:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return save(self, step, *args, **kwargs)
  monkeypatch.setattr(checkpoint.ocp.CheckpointManager, "save", fails_the_second_time)
  workdir = str(tmp_path / "run")
  capsys.readouterr()
  assert train_main([f"--workdir={workdir}", *BASE]) == 1
  assert "No space left on device; checkpoint 4 is intact" in capsys.readouterr().err
  monkeypatch.undo()
  assert _steps(workdir) == [4]
  assert train_main([f"--workdir={workdir}", *BASE]) == 0
  assert _outputs(workdir) == _outputs(reference)


def test_without_a_checkpoint_a_workdir_starts_over(tmp_path, capsys):
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "metrics.jsonl").write_text('{"event": "stale"}\n')
  args = [*BASE, "--config.checkpoint.every=0"]
  assert train_main([f"--workdir={workdir}", *args]) == 0
  reference = str(tmp_path / "reference")
  assert train_main([f"--workdir={reference}", *args]) == 0
  assert _outputs(str(workdir)) == _outputs(reference)
  assert not os.path.exists(workdir / "checkpoints")
  assert "no checkpoint in" in capsys.readouterr().err


def test_ctrl_c_stops_with_status_130_and_names_the_checkpoint_to_resume_from(tmp_path):
  workdir = str(tmp_path / "run")
  args = [f"--workdir={workdir}", *BASE, "--config.budget.tokens=20000",
          "--config.checkpoint.every=2"]
  process = subprocess.Popen([sys.executable, "-m", "heloco_jax.cli.train", *tiny.once(args)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 300
  while not _steps(workdir) and process.poll() is None and time.monotonic() < deadline:
    time.sleep(0.02)
  process.send_signal(signal.SIGINT)
  _, err = process.communicate()
  assert process.returncode == 130, err[-2000:]
  assert f"interrupted; checkpoint {_steps(workdir)[-1]} is intact: re-run the same command" in err


def test_sigterm_checkpoints_at_the_next_boundary_and_the_rerun_ends_as_an_uninterrupted_run(
    tmp_path):
  """Preemption (Cloud TPU, spot VMs): SIGTERM → checkpoint at the end of the arrival in
  progress, exit 143 naming it; the same command then resumes exactly."""
  args = [*BASE, "--config.budget.tokens=8000", "--config.checkpoint.every=50"]
  reference = str(tmp_path / "reference")
  assert train_main([f"--workdir={reference}", *args]) == 0
  workdir = str(tmp_path / "run")
  process = subprocess.Popen([sys.executable, "-m", "heloco_jax.cli.train", f"--workdir={workdir}",
                              *tiny.once(args)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
  metrics = os.path.join(workdir, "metrics.jsonl")
  deadline = time.monotonic() + 300
  while process.poll() is None and time.monotonic() < deadline and not (
      os.path.exists(metrics) and '"arrival"' in open(metrics).read()):
    time.sleep(0.02)
  process.send_signal(signal.SIGTERM)
  _, err = process.communicate()
  assert process.returncode == 143, err[-2000:]
  steps = _steps(workdir)
  assert steps and steps[-1] < 50  # written at the stop, not by the periodic cadence
  assert (f"stopped by SIGTERM (preemption) at the end of an arrival; checkpoint {steps[-1]} "
          "is intact: re-run the same command to resume") in err
  assert train_main([f"--workdir={workdir}", *args]) == 0
  assert _outputs(workdir) == _outputs(reference)


def test_a_failed_resume_with_another_config_leaves_the_workdir_to_its_own_command(
    tmp_path, capsys):
  workdir, reference = _finished_then_reopened(tmp_path, BASE)
  with open(os.path.join(workdir, "config.json")) as f:
    before = f.read()
  capsys.readouterr()
  assert train_main([f"--workdir={workdir}", *BASE, "--config.num_workers=4",
                     "--allow_config_change"]) == 2
  err = capsys.readouterr().err
  assert "no readable checkpoint" in err and "resume only with that config" in err
  assert len(err.strip().splitlines()) == 1
  with open(os.path.join(workdir, "config.json")) as f:
    assert f.read() == before  # not replaced by the failed resume's config
  assert train_main([f"--workdir={workdir}", *BASE]) == 0
  assert _outputs(workdir) == reference


def test_a_garbage_config_json_is_refused_in_one_line(tmp_path, capsys):
  workdir, reference = _finished_then_reopened(tmp_path, BASE)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write("{not json")
  capsys.readouterr()
  assert train_main([f"--workdir={workdir}", *BASE]) == 2
  err = capsys.readouterr().err
  assert "config.json is not valid JSON" in err and "--allow_config_change" in err
  assert len(err.strip().splitlines()) == 1
  assert train_main([f"--workdir={workdir}", *BASE, "--allow_config_change"]) == 0
  assert _outputs(workdir) == reference


@pytest.mark.parametrize("method", ["mla", "diloco", "ddp"])
def test_a_budget_below_one_dispatch_is_refused_in_one_line(tmp_path, capsys, method):
  assert train_main([f"--workdir={tmp_path / 'run'}", *TINY, f"--config.method={method}",
                     "--config.budget.tokens=100"]) == 2
  err = capsys.readouterr().err
  assert "ended before any work reached the server" in err, err
  assert "allowed: a budget that holds at least one" in err


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EPERM])
def test_a_row_that_cannot_be_written_stops_in_one_line_and_the_run_resumes(
    tmp_path, capsys, monkeypatch, code):
  """The disk fills (or metrics.jsonl turns unwritable) while rows are written: one line
  naming the intact checkpoint, exit 1, no second error from closing; the rerun completes."""
  from heloco_jax.rundir import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  reference = str(tmp_path / "reference")
  assert train_main([f"--workdir={reference}", *BASE]) == 0
  write = workdir_lib.RunDirectory.write_row
  rows = []

  def fails_at_row_12(self, row):
    rows.append(row)
    if len(rows) == 12:
      raise OSError(code, os.strerror(code))
    return write(self, row)
  monkeypatch.setattr(workdir_lib.RunDirectory, "write_row", fails_at_row_12)
  workdir = str(tmp_path / "run")
  capsys.readouterr()
  assert train_main([f"--workdir={workdir}", *BASE]) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("heloco-jax train: cannot write to --workdir=") and (
      os.strerror(code) in err[-1] and " is intact: re-run the same command" in err[-1]), err
  assert not any("Traceback" in line for line in err)
  monkeypatch.undo()
  assert train_main([f"--workdir={workdir}", *BASE]) == 0
  assert _outputs(workdir) == _outputs(reference)


# Kill trials (issue 38's attack, kept): a signal at a random metrics row, then the same
# command; the run must end as the uninterrupted one, TensorBoard included. 36 trials: every
# (signal, method) pair four times, at rows drawn from a seeded generator.
TRIAL_METHODS = {
    "heloco": ["--config.speeds=severe", "--config.jitter=0.2", "--config.budget.tokens=8000",
               "--config.checkpoint.every=3"],
    "diloco": ["--config.speeds=mild", "--config.budget.tokens=8000",
               "--config.checkpoint.every=2"],
    "palsgd": ["--config.speeds=mild", "--config.budget.tokens=8000",
               "--config.checkpoint.every=2", "--config.palsgd_warmup_steps=4"],
}
TRIAL_SIGNALS = {"SIGKILL": -signal.SIGKILL, "SIGTERM": 143, "SIGINT": 130}
TRIALS = [(s, m, t) for s in TRIAL_SIGNALS for m in TRIAL_METHODS for t in range(4)]


@pytest.fixture(scope="module")
def trial_references(tmp_path_factory):
  """method -> (outputs, TensorBoard scalars) of its uninterrupted run."""
  references = {}
  for method, extra in TRIAL_METHODS.items():
    workdir = str(tmp_path_factory.mktemp("reference") / method)
    assert train_main([f"--workdir={workdir}", *TINY, f"--config.method={method}", *extra]) == 0
    references[method] = (_outputs(workdir),
                          test_writers.read_scalars(os.path.join(workdir, "tensorboard")))
  return references


def _signal_at_row(args, workdir, row, sig, timeout=300):
  """Runs `heloco-jax train ARGS`, sends ``sig`` once metrics.jsonl holds ``row`` rows; its
  exit status, or None when it ended by itself before that."""
  process = subprocess.Popen([sys.executable, "-m", "heloco_jax.cli.train", *tiny.once(args)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  metrics = os.path.join(workdir, "metrics.jsonl")
  deadline = time.monotonic() + timeout
  while process.poll() is None and time.monotonic() < deadline:
    try:
      with open(metrics) as f:
        if f.read().count("\n") >= row:
          process.send_signal(getattr(signal, sig))
          break
    except OSError:
      pass
    time.sleep(0.01)
  _, err = process.communicate()
  if process.returncode == 0:
    return None
  assert "Traceback" not in err, err[-3000:]
  return process.returncode


@pytest.mark.slow
@pytest.mark.parametrize("sig,method,trial", TRIALS)
def test_a_signal_at_a_random_row_then_the_same_command_gives_the_uninterrupted_run(
    tmp_path, trial_references, sig, method, trial):
  rng = np.random.default_rng([TRIALS.index((sig, method, trial))])
  args = [f"--workdir={tmp_path}", *TINY, f"--config.method={method}", *TRIAL_METHODS[method]]
  (reference, reference_scalars) = trial_references[method]
  rows = reference[0].count("\n")
  status = _signal_at_row(args, str(tmp_path), int(rng.integers(1, rows)), sig)
  if status is not None:  # None: it finished first (a signal sent as it wrote its summary)
    assert status == TRIAL_SIGNALS[sig]
    assert train_main(args) == 0
  assert _outputs(str(tmp_path)) == reference
  scalars = test_writers.read_scalars(os.path.join(tmp_path, "tensorboard"))
  assert {t: sorted(v) for t, v in scalars.items()} == {
      t: sorted(v) for t, v in reference_scalars.items()}
