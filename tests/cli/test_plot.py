"""``heloco-jax plot``: figures for every method, several runs overlaid, a run in progress."""

import os
import shutil

import pytest

from heloco_jax.cli import main as cli
from heloco_jax.training import methods
from tests.cli.test_cli import TINY

# One worker process runs this module, so its runs (a module fixture) are trained once.
pytestmark = pytest.mark.xdist_group("plot_runs")

SYNC = ("ddp", "local_sgd", "diloco", "palsgd")
ARRIVAL_FIGURES = ("staleness_per_worker.png", "alignment.png", "arrivals_timeline.png")


class _Runs(dict):
  """Each method's run directory, trained on first use (``-m slow`` uses them all)."""

  def __init__(self, root):
    super().__init__()
    self.root = root

  def __missing__(self, method):
    self[method] = str(self.root / method)
    tiny = [arg for arg in TINY if not arg.startswith("--config.speeds=")]  # a flag once only
    assert cli.main(["train", f"--workdir={self[method]}", *tiny, f"--config.method={method}",
                     "--config.budget.tokens=2048", "--config.speeds=[1.0,2.0,3.0]",
                     "--config.writers=jsonl",
                     *(["--config.palsgd_warmup_steps=0"] if method == "palsgd" else [])]) == 0
    return self[method]


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory):
  return _Runs(tmp_path_factory.mktemp("plot_runs"))


# Every kind of run in the default suite (steps, rounds, arrivals); the other methods' runs
# draw the same figures from the same rows: -m slow (the default suite stays under 15 min).
DEFAULT = ("ddp", "diloco", "mla", "heloco")


@pytest.mark.parametrize("method", [m if m in DEFAULT else pytest.param(m, marks=pytest.mark.slow)
                                    for m in methods.METHODS])
def test_every_method_gets_its_figures(run_dirs, method, capsys):
  assert cli.main(["plot", run_dirs[method]]) == 0
  out = os.path.join(run_dirs[method], "plots")
  expected = ["loss_vs_tokens.png", "loss_vs_sim_time.png"]
  if method not in SYNC:
    expected += list(ARRIVAL_FIGURES)
  for name in expected:
    assert os.path.getsize(os.path.join(out, name)) > 5_000, name
  assert sorted(os.listdir(out)) == sorted(expected)
  assert capsys.readouterr().out.split() == [os.path.join(out, n) for n in expected]


def test_runs_overlaid_and_a_run_in_progress(run_dirs, tmp_path):
  partial = tmp_path / "partial"
  shutil.copytree(run_dirs["heloco"], partial)
  with open(partial / "metrics.jsonl", "rb+") as f:  # cut in the middle of a row
    f.truncate(os.path.getsize(partial / "metrics.jsonl") * 2 // 3)
  out = tmp_path / "figures"
  assert cli.main(["plot", run_dirs["mla"], run_dirs["diloco"], str(partial),
                   f"--out={out}"]) == 0
  for name in ("loss_vs_tokens.png", *ARRIVAL_FIGURES):
    assert os.path.getsize(out / name) > 5_000


def test_a_folder_that_is_not_a_run_is_one_line(tmp_path, capsys):
  assert cli.main(["plot", str(tmp_path)]) == 2
  assert "is not a run directory: it has no metrics.jsonl" in capsys.readouterr().err


def test_an_api_run_counted_in_steps_gets_its_loss_and_each_eval_metric_drawn(tmp_path, capsys):
  """Issue 57: an hj.simulate run (steps, not tokens) drew an empty loss figure, and an
  eval_fn's accuracy was never drawn."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  import heloco_jax as hj  # pylint: disable=g-import-not-at-top

  def loss(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] - y) ** 2)

  def data(worker):
    rng = np.random.default_rng(worker)
    while True:
      x = rng.normal(0, 1, (8, 2)).astype(np.float32)
      yield x, x @ np.array([[1.0], [-1.0]], np.float32)

  x_val = np.random.default_rng(5).normal(0, 1, (64, 2)).astype(np.float32)
  y_val = x_val @ np.array([[1.0], [-1.0]], np.float32)
  hj.simulate(loss, {"w": jnp.zeros((2, 1))}, [data(0), data(1)], inner_tx=optax.sgd(0.1),
              inner_steps=2, speeds=[1.0, 2.0], budget=hj.Budget(steps=40, eval_every_steps=10),
              eval_fn=lambda p: {"val_loss": loss(p, (x_val, y_val)),
                                 "accuracy": jnp.mean(jnp.sign(x_val @ p["w"]) == jnp.sign(y_val))},
              workdir=str(tmp_path / "run"))
  assert cli.main(["plot", str(tmp_path / "run"), f"--out={tmp_path / 'out'}"]) == 0
  written = sorted(os.listdir(tmp_path / "out"))
  for name in ("loss_vs_steps.png", "loss_vs_sim_time.png", "accuracy_vs_steps.png"):
    assert name in written
    assert os.path.getsize(tmp_path / "out" / name) > 5_000, name
  assert "loss_vs_tokens.png" not in written
  capsys.readouterr()


def _write_run(path, evals, arrivals=()):
  """A run directory written by hand: ``evals`` and ``arrivals`` as metrics.jsonl rows."""
  import json  # pylint: disable=g-import-not-at-top
  os.makedirs(path)
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    for row in evals:
      f.write(json.dumps({"event": "eval", "tokens": 0, "sim_time": 0.0, "outer_updates": 0,
                          "val_loss": 1.0, **row}) + "\n")
    for row in arrivals:
      f.write(json.dumps({"event": "arrival", "worker": 0, "staleness": 0, "sim_time": 1.0,
                          **row}) + "\n")


@pytest.mark.parametrize("key", ["k" * 300, "a\x00b", "a/b"])
def test_an_eval_key_that_makes_no_file_name_gets_a_safe_one(tmp_path, capsys, key):
  """Issue 78: an eval key 300 characters long or holding a NUL: "cannot write to --out",
  blaming --out, after 2 figures were written. Its figure gets a safe file name now (the
  key's characters a file name allows, cut short, with a hash of the key when changed)."""
  _write_run(tmp_path / "run", [{"tokens": t, key: 0.5 + t} for t in (0, 10)])
  assert cli.main(["plot", str(tmp_path / "run"), f"--out={tmp_path / 'out'}"]) == 0
  written = sorted(os.listdir(tmp_path / "out"))
  extra = [name for name in written if not name.startswith("loss_vs_")]
  assert len(extra) == 1, written
  assert len(extra[0]) <= 128 and "\x00" not in extra[0] and extra[0].endswith("_vs_tokens.png")
  if key == "a/b":
    assert extra == ["a_b_vs_tokens.png"]  # as before
  assert capsys.readouterr().out.split() == [str(tmp_path / "out" / n) for n in (
      "loss_vs_tokens.png", "loss_vs_sim_time.png", extra[0])]


def test_eval_keys_that_meet_in_one_file_name_get_one_figure_each(tmp_path, capsys):
  """"a/b" and "a_b" were both drawn into a_b_vs_tokens.png, the second over the first."""
  _write_run(tmp_path / "run", [{"tokens": t, "a/b": 1.0, "a_b": 2.0} for t in (0, 10)])
  assert cli.main(["plot", str(tmp_path / "run"), f"--out={tmp_path / 'out'}"]) == 0
  assert len(os.listdir(tmp_path / "out")) == 4
  capsys.readouterr()


def test_arrival_rows_with_a_non_finite_sim_time_are_named_in_a_warning(tmp_path, capsys):
  """Issue 78: an arrival row whose sim_time is Infinity or NaN was dropped without a word."""
  _write_run(tmp_path / "run", [{"tokens": t} for t in (0, 10)],
             [{"sim_time": 1.0}, {"sim_time": float("inf")}, {"sim_time": float("nan")},
              {"sim_time": 2.0}])
  assert cli.main(["plot", str(tmp_path / "run"), f"--out={tmp_path / 'out'}"]) == 0
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [f"heloco-jax plot: warning: {tmp_path / 'run' / 'metrics.jsonl'}: 2 arrival "
                 "rows with a sim_time that is not finite (Infinity or NaN) are left out of the "
                 "figures"], err
  assert os.path.getsize(tmp_path / "out" / "arrivals_timeline.png") > 5_000
