"""Issue 38: misuses that gave tracebacks or crashes end in one line naming what to change."""

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import heloco_jax as hj
from heloco_jax.cli import train

# A tiny CLI run (test_resume.py's).
TINY = ["--config.model.d_model=32", "--config.model.num_layers=1", "--config.model.num_heads=2",
        "--config.model.context=16", "--config.batch_size=4", "--config.inner_steps=2",
        "--config.data.max_bytes_per_language=40000", "--config.data.val_sequences_per_language=8",
        "--config.budget.eval_every_tokens=1000", "--config.inner.warmup_steps=2"]
W = np.array([[1.0], [-2.0]], np.float32)


def _loss(params, batch):
  x, y = batch
  return jnp.mean((x @ params["w"] - y) ** 2)


class Counting:
  """An endless stream that counts the batches read from it."""

  def __init__(self):
    self.read = 0

  def __iter__(self):
    rng = np.random.default_rng(0)
    while True:
      self.read += 1
      x = rng.normal(0, 1, (4, 2)).astype(np.float32)
      yield x, x @ W


def _run(data, **kwargs):
  args = dict(inner_tx=optax.sgd(0.05), inner_steps=2, speeds=[1.0, 2.0],
              budget=hj.Budget(steps=20))
  args.update(kwargs)
  return hj.simulate(_loss, {"w": jnp.zeros((2, 1))}, data, **args)


def test_a_batch_that_is_none_names_the_worker():
  def nones():
    while True:
      yield None
  with pytest.raises(ValueError, match="worker 1's batch 0 is None; allowed: a pytree"):
    _run([Counting(), nones()])


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, True])
def test_a_seed_out_of_range_is_one_line(seed):
  with pytest.raises(ValueError, match=r"seed=.* is not allowed; allowed: an integer in"):
    _run([Counting(), Counting()], seed=seed)


def test_a_budget_no_dispatch_fits_fails_before_reading_the_batches():
  streams = [Counting(), Counting()]
  with pytest.raises(hj.BudgetError, match="at least one dispatch, 100000000 steps"):
    _run(streams, inner_steps=10**8, budget=hj.Budget(steps=10))
  assert [s.read for s in streams] == [1, 0]  # worker 0's first batch checked loss_fn


def test_empty_params_are_refused():
  with pytest.raises(ValueError, match="params holds no arrays"):
    hj.make_engine(_loss, {}, [Counting()], budget=hj.Budget(steps=10))


@pytest.mark.parametrize("text,message", [
    (None, "no such file"),
    ("def get_config(:\n", "does not load: SyntaxError"),
    ("def get_config():\n  raise RuntimeError('boom')\n", "get_config\\(\\) raised RuntimeError: boom"),
    ("def get_config():\n  return {'method': 'heloco'}\n", "returned a dict; allowed: an "
     "ml_collections.ConfigDict"),
    ("x = 1\n", "has no get_config\\(\\)"),
])
def test_a_bad_config_file_is_one_line(tmp_path, capsys, text, message):
  path = tmp_path / "config.py"
  if text is not None:
    path.write_text(text)
  assert train.main([f"--workdir={tmp_path / 'run'}", f"--config={path}"]) == 2
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
  assert __import__("re").search(message, err), err


def test_a_stray_positional_argument_is_refused(tmp_path, capsys):
  assert train.main([f"--workdir={tmp_path}", "config.budget.tokens=600000"]) == 2
  assert ("unexpected argument 'config.budget.tokens=600000'" in capsys.readouterr().err)


def test_a_closed_stderr_never_stops_the_run(tmp_path):
  workdir = tmp_path / "run"
  process = subprocess.Popen(
      [sys.executable, "-m", "heloco_jax.cli.train", f"--workdir={workdir}", *TINY,
       "--config.budget.tokens=4000"],
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  process.stderr.readline()  # as `| head -1`: one line, then the reader is gone
  process.stderr.close()
  assert process.wait(timeout=600) == 0
  assert os.path.exists(workdir / "summary.json")


def _plot_run(tmp_path, lines, config='{"method": "heloco", "speeds": [1, 2]}'):
  run = tmp_path / "run"
  run.mkdir(exist_ok=True)
  (run / "config.json").write_text(config)
  good = ['{"event": "eval", "steps": 0, "sim_time": 0.0, "outer_updates": 0, "val_loss": 2.0}',
          '{"event": "arrival", "worker": 0, "staleness": 0, "steps": 2, "sim_time": 1.0, '
          '"outer_updates": 1, "cosine_mean": 0.5}',
          '{"event": "eval", "steps": 2, "sim_time": 1.0, "outer_updates": 1, "val_loss": 1.0}']
  (run / "metrics.jsonl").write_text("\n".join(good[:1] + lines + good[1:]) + "\n")
  return run


@pytest.mark.parametrize("line,message", [
    ("garbage{", r"metrics.jsonl:2: not valid JSON"),
    ("[1, 2]", r"metrics.jsonl:2: a list; allowed: a JSON object"),
    ('{"event": "eval", "steps": 1, "sim_time": 0.5}', "an eval row without val_loss"),
    ('{"event": "arrival", "worker": 5000000, "staleness": 0, "sim_time": 1.0}',
     r"worker is 5000000; allowed: an integer in \[0, 4095\]"),
    ('{"event": "arrival", "worker": 0, "staleness": 1e12, "sim_time": 1.0}',
     "staleness is 1000000000000.0"),
])
def test_plot_names_a_malformed_row_instead_of_dropping_or_hanging(tmp_path, capsys, line,
                                                                    message):
  from heloco_jax.cli import plot  # pylint: disable=g-import-not-at-top
  run = _plot_run(tmp_path, [line])
  assert plot.main([str(run)]) == 2
  err = capsys.readouterr().err
  assert __import__("re").search(message, err) and len(err.strip().splitlines()) == 1, err


def test_plot_takes_numeric_speeds_sparse_worker_ids_and_refuses_an_out_file(tmp_path, capsys):
  from heloco_jax.cli import plot  # pylint: disable=g-import-not-at-top
  run = _plot_run(tmp_path, ['{"event": "arrival", "worker": 4000, "staleness": 3, '
                             '"sim_time": 2.0, "outer_updates": 2}'])
  assert plot.main([str(run)]) == 0
  out_file = tmp_path / "a_file"
  out_file.write_text("x")
  assert plot.main([str(run), "--out", str(out_file)]) == 2
  assert "cannot write to --out" in capsys.readouterr().err
  (run / "config.json").write_text("[1, 2]")
  assert plot.main([str(run)]) == 2


def test_server_arrive_with_a_pseudo_gradient_of_another_shape_names_the_leaf():
  server = hj.Server(hj.mla(0.7, 0.9, num_workers=2), {"w": jnp.zeros((2, 1))})
  server.dispatch(worker=0)
  with pytest.raises(ValueError, match=r"arrive\(worker=0\): the pseudo-gradient's leaf 'w' "
                                       r"has shape \(3, 1\); allowed: θ's, \(2, 1\)"):
    server.arrive({"w": jnp.ones((3, 1))}, worker=0)


@pytest.mark.parametrize("override", ["--config.model.d_model=65536",
                                      "--config.num_workers=1000000000000"])
def test_sizes_that_cannot_fit_fail_before_any_work(tmp_path, capsys, override):
  assert train.main([f"--workdir={tmp_path / 'run'}", override]) == 2
  err = capsys.readouterr().err
  assert "is not allowed" in err and len(err.strip().splitlines()) == 1, err
  assert not (tmp_path / "run").exists()


def test_an_unreachable_ray_address_is_one_line_at_once(tmp_path, capsys):
  pytest.importorskip("ray")
  import time  # pylint: disable=g-import-not-at-top
  start = time.monotonic()
  assert train.main([f"--workdir={tmp_path / 'run'}", "--config.runtime=ray",
                     "--config.ray.address=127.0.0.1:1", *TINY]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert "nothing answers at ray.address='127.0.0.1:1'" in err[-1], err
  assert time.monotonic() - start < 60
