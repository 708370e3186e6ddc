"""``heloco-jax plot``: figures for every method, several runs overlaid, a run in progress."""

import os
import shutil

import pytest

from heloco_jax import cli, methods
from tests.test_cli import TINY

# One worker process runs this module, so its runs (a module fixture) are trained once.
pytestmark = pytest.mark.xdist_group("plot_runs")

SYNC = ("ddp", "local_sgd", "diloco", "palsgd")
ARRIVAL_FIGURES = ("staleness_per_worker.png", "alignment.png", "arrivals_timeline.png")


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp("plot_runs")
  dirs = {}
  for method in methods.METHODS:
    dirs[method] = str(root / method)
    assert cli.main(["train", f"--workdir={dirs[method]}", *TINY, f"--config.method={method}",
                     "--config.budget.tokens=2048", "--config.speeds=[1.0,2.0,3.0]",
                     "--config.writers=jsonl", "--config.palsgd_warmup_steps=0"]) == 0
  return dirs


@pytest.mark.parametrize("method", list(methods.METHODS))
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
