"""Issue 61's third attack: inputs from user code checked where they enter, runs whose workers
all left end in a stated reason, and every error names the key that is wrong."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tiny

import heloco_jax as hj
from heloco_jax.cli import main as cli
from heloco_jax.comm import compress
from heloco_jax.rundir import writers
from tests.cli.test_cli import TINY

W = np.array([[1.0], [-2.0]], np.float32)


def _loss(params, batch):
  x, y = batch
  return jnp.mean((x @ params["w"] - y) ** 2)


def _data(worker):
  rng = np.random.default_rng(worker)
  while True:
    x = rng.normal(0, 1, (4, 2)).astype(np.float32)
    yield x, x @ W


def _simulate(**more):
  kwargs = dict(inner_tx=optax.sgd(0.05), inner_steps=2, speeds=[1.0, 2.0],
                budget=hj.Budget(steps=24))
  kwargs.update(more)
  return hj.simulate(_loss, {"w": jnp.zeros((2, 1), jnp.float32)}, [_data(0), _data(1)],
                     **kwargs)


def _with_nbytes(nbytes):
  base = compress.int8()
  return compress.Compressor(base.init, base.compress, base.decompress, lambda payload: nbytes)


@pytest.mark.parametrize("nbytes", [-5, math.nan, 10.5, "12", math.inf])
def test_a_compressor_whose_nbytes_is_not_a_byte_count_is_refused(nbytes):
  """Before: a negative nbytes ran the simulated clock backwards (sim_time −119,937 s)."""
  with pytest.raises(ValueError, match=r"compress: nbytes\(payload\) returned .*allowed: an "
                                       r"integer >= 0"):
    _simulate(compress=_with_nbytes(nbytes), comm=hj.CommModel(bandwidth=1e3))


def test_numpy_integer_nbytes_is_a_byte_count():
  result = _simulate(compress=_with_nbytes(np.int64(40)), comm=hj.CommModel(bandwidth=1e3))
  assert [r["bytes_up"] for r in result.history if r["event"] == "arrival"][0] == 40


def test_a_compressor_whose_decompress_changes_the_shape_is_refused():
  base = compress.int8()
  wrong = compress.Compressor(base.init, base.compress,
                              lambda payload: jax.tree.map(lambda x: x[:1],
                                                           base.decompress(payload)), base.nbytes)
  with pytest.raises(ValueError, match=r"compress: decompress\(payload\) gives .* allowed: "
                                       "Δ's structure, shapes and dtypes"):
    _simulate(compress=wrong)


EVERYONE_LEAVES = hj.Membership(((0, 5.0, math.inf), (1, 5.0, math.inf)))


def test_a_run_whose_workers_all_left_says_so_in_its_summary_and_a_warning():
  """Before: ddp and palsgd ended with a normal summary after 5 of 60 steps."""
  with pytest.warns(UserWarning, match="stopped before its budget: every worker left at 5 s"):
    result = _simulate(method="ddp", membership=EVERYONE_LEAVES, budget=hj.Budget(steps=60))
  assert result.summary["stopped"] == "every worker left at 5 s"
  assert result.summary["steps"] < 60


def test_a_run_whose_workers_all_left_before_any_work_blames_the_departures():
  """Before: heloco and diloco blamed the budget."""
  with pytest.raises(hj.BudgetError, match="every worker left for good by 5 s, before any work"):
    _simulate(method="heloco", membership=EVERYONE_LEAVES, speeds=[4.0, 8.0])


def test_the_cli_prints_the_stop_reason_instead_of_done(tmp_path, capsys):
  code = cli.main(["train", f"--workdir={tmp_path / 'run'}", *TINY, "--config.method=ddp",
                   "--config.budget.tokens=20000", "--config.chaos.schedule=0@5,1@5,2@5"])
  err = capsys.readouterr().err
  assert code == 0, err
  assert "stopped: every worker left at 5 s:" in err and "done:" not in err


@pytest.mark.parametrize("overrides, key", [
    (["--config.method=ddp", "--config.compression.error_feedback=true"],
     "config.compression.error_feedback=True is not allowed; allowed: False with method='ddp'"),
    (["--config.compression.kind=int8", "--config.compression.block=1000000000"],
     "config.compression.block=1000000000 is not allowed"),
    (["--config.compression.download=true"],
     "config.compression.download=True is not allowed; allowed: False with "
     "compression.kind='none'"),
    (["--config.method=diloco", "--config.compression.kind=int8",
      "--config.compression.download=true"],
     "config.compression.download=True is not allowed; allowed: False with method='diloco'; "
     "compressed downloads run the asynchronous methods"),
    (["--config.chaos.rate=1", "--config.chaos.downtime=1e-300"],
     "config.chaos.downtime=1e-300 is not allowed"),
    (["--config.method=cgad", "--config.outer.age_decay=4e38"], "decay=4e+38 is not allowed"),
    (["--config.chaos.rate=0.5", "--config.chaos.downtime=100", "--config.chaos.schedule=0@1"],
     "config.chaos.rate=0.5 is not allowed; allowed: chaos.rate=0 with a schedule"),
])
def test_errors_name_the_key_that_is_wrong(tmp_path, capsys, overrides, key):
  code = cli.main(["train", f"--workdir={tmp_path / 'run'}", *TINY,
                   "--config.budget.tokens=20000", *overrides])
  err = capsys.readouterr().err
  assert code == 2 and key in err, err
  assert len(err.strip().splitlines()) <= 2, err


def test_a_quorum_the_budget_cannot_hold_is_named():
  with pytest.raises(hj.BudgetError, match="at least one quorum of 2 dispatches, 4 steps"):
    _simulate(syncer=hj.Syncer(quorum=2), budget=hj.Budget(steps=3))


def test_a_membership_with_a_string_time_is_one_line():
  with pytest.raises(ValueError, match=r"leave='10'.*allowed: numbers of seconds"):
    _simulate(membership=hj.Membership(((0, "10", 20.0),)))


def test_numpy_scalars_are_accepted_where_python_numbers_are(tmp_path):
  """Before: streaming's alpha=np.float32(0.5) and hj.Syncer(quorum=np.int64(2)) were
  refused."""
  def two_leaves(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)
  hj.simulate(two_leaves, {"w": jnp.zeros((2, 1), jnp.float32), "b": jnp.zeros(1, jnp.float32)},
              [_data(0), _data(1)], inner_tx=optax.sgd(0.05), inner_steps=2, speeds=[1.0, 2.0],
              budget=hj.Budget(steps=24),
              streaming=hj.Streaming(fragments=np.int64(2), alpha=np.float32(0.5)))
  _simulate(syncer=hj.Syncer(quorum=np.int64(2), grace_window=np.float64(0.5)))
  _simulate(workdir=hj.Workdir(str(tmp_path / "run"), checkpoint_every=np.int64(0)))


def test_the_tensorboard_writer_takes_a_clock_past_float_range(tmp_path):
  """Before: comm.bandwidth=1e-300 made sim_time inf, and int(inf) crashed the writer."""
  writer = writers.TensorBoardWriter(str(tmp_path))
  writer({"event": "eval", "tokens": 10, "sim_time": math.inf, "outer_updates": 1,
          "val_loss": 2.0})
  writer({"event": "arrival", "tokens": 10, "sim_time": math.inf, "outer_updates": 1,
          "worker": 0, "staleness": 0, "train_loss": 2.0})
  writer.close()


@pytest.mark.parametrize("row, message", [
    ('{"event": "eval", "tokens": "many", "sim_time": 1.0, "val_loss": 2.0}',
     "metrics.jsonl:2: an eval row's tokens is 'many'; allowed: a finite number"),
    ('{"event": "eval", "tokens": 20, "sim_time": 1.0, "val_loss": NaN}',
     "metrics.jsonl:2: an eval row's val_loss is nan"),
    ('{"event": "eval", "tokens": 20, "sim_time": Infinity, "val_loss": 2.0}',
     "metrics.jsonl:2: an eval row's sim_time is inf"),
    ('{"event": "eval", "tokens": 20, "val_loss": 2.0}',
     "metrics.jsonl:2: an eval row without sim_time"),
    ('{"event": "eval", "sim_time": 3.0, "val_loss": 2.0}',
     "metrics.jsonl:2: an eval row without tokens or steps"),
])
def test_plot_names_every_row_it_cannot_draw(tmp_path, capsys, row, message):
  """Before: a categorical axis for "many", and such rows dropped without a word."""
  run = tmp_path / "run"
  run.mkdir()
  (run / "metrics.jsonl").write_text(
      '{"event": "eval", "tokens": 0, "sim_time": 0.0, "val_loss": 3.0}\n' + row + "\n"
      '{"event": "eval", "tokens": 40, "sim_time": 2.0, "val_loss": 1.0}\n')
  assert cli.main(["plot", str(run)]) == 2
  assert message in capsys.readouterr().err


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_every_file_a_run_writes_follows_the_umask(tmp_path, umask):
  """Before: summary.json, config.json and the plots were 0600 (mkstemp), metrics.jsonl 0644."""
  before = os.umask(umask)
  try:
    _simulate(workdir=str(tmp_path / "run"), eval_fn=lambda p: _loss(p, next(_data(9))),
              budget=hj.Budget(steps=24, eval_every_steps=12))
    assert cli.main(["plot", str(tmp_path / "run")]) == 0
  finally:
    os.umask(before)
  want = 0o666 & ~umask
  for name in ("config.json", "metrics.jsonl", "summary.json", "run_id",
               "plots/loss_vs_steps.png"):
    assert os.stat(tmp_path / "run" / name).st_mode & 0o777 == want, name


def test_a_refused_resume_beside_a_half_written_checkpoint_is_one_line(tmp_path, capfd):
  """Before: orbax's background clean-up of N.orbax-checkpoint-tmp-* printed a 50-line
  'cannot schedule new futures after shutdown' after the one-line refusal (1 in 3 tries)."""
  run = tmp_path / "run"
  engine = hj.make_engine(_loss, {"w": jnp.zeros((2, 1), jnp.float32)}, [_data(0), _data(1)],
                          inner_tx=optax.sgd(0.05), inner_steps=2, speeds=[1.0, 2.0],
                          budget=hj.Budget(steps=40),
                          workdir=hj.Workdir(str(run), checkpoint_every=2))
  tiny.stop_after_rows(engine, 8)
  half = run / "checkpoints" / "9.orbax-checkpoint-tmp-1764262800"
  half.mkdir()
  (half / "arrays").mkdir()
  capfd.readouterr()
  for _ in range(3):
    with pytest.raises(hj.WorkdirError, match="holds a run with another config"):
      _simulate(workdir=hj.Workdir(str(run), checkpoint_every=2), budget=hj.Budget(steps=40),
                inner_steps=3)
  assert not half.exists()
  err = capfd.readouterr().err
  assert "cannot schedule new futures" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("comm", ["--config.comm.bandwidth=1e-300", "--config.comm.latency=1e308"])
def test_a_clock_past_float_range_finishes_with_tensorboard_events(tmp_path, capsys, comm):
  """Before: the TensorBoard writer turned an infinite sim_time into an int and crashed."""
  code = cli.main(["train", f"--workdir={tmp_path / 'run'}", *TINY, "--config.budget.tokens=2048",
                   "--config.writers=jsonl,tensorboard", comm])
  err = capsys.readouterr().err
  assert code == 0, err
  assert any(name.startswith("events.out.tfevents.")
             for name in os.listdir(tmp_path / "run" / "tensorboard"))
