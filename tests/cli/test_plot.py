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
    assert cli.main(["train", f"--workdir={self[method]}", *TINY, f"--config.method={method}",
                     "--config.budget.tokens=2048", "--config.speeds=[1.0,2.0,3.0]",
                     "--config.writers=jsonl", "--config.palsgd_warmup_steps=0"]) == 0
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
