"""Metric writers: TensorBoard event files read back, from the CLI and from hj.simulate."""

import glob
import json
import os
import struct

import pytest

from heloco_jax.rundir import writers

pytest.importorskip("tensorboardX")
from tensorboardX.proto import event_pb2  # noqa: E402


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
  """tag -> [(step, value)] from the TFRecord event files in ``logdir`` (length, CRC, event,
  CRC per record), without TensorFlow or TensorBoard."""
  scalars: dict[str, list[tuple[int, float]]] = {}
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    offset = 0
    while offset < len(data):
      (length,) = struct.unpack("<Q", data[offset:offset + 8])
      event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
      offset += 12 + length + 4
      for value in event.summary.value:
        scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
  return scalars


def test_rows_become_scalars_against_tokens_and_outer_updates(tmp_path):
  writer = writers.TensorBoardWriter(str(tmp_path))
  writer({"event": "eval", "tokens": 0, "sim_time": 0.0, "outer_updates": 0, "val_loss": 5.5,
          "val_loss/en": 5.25})
  writer({"event": "arrival", "worker": 1, "staleness": 3, "tokens": 2048, "sim_time": 20.0,
          "outer_updates": 1, "train_loss": 5.0, "cosine_mean": 0.5, "rotation_mean": 0.25, "shrinkage_mean": 0.125, "weight": 0.5,
          "branch_count/keep": 3, "branch_count/shrink": 1, "branch_count/rotate": 0,
          "branch_count/pass": 0})
  writer({"event": "rejected", "worker": 2, "outer_updates": 1, "reason": "nan"})
  writer({"event": "train", "tokens": 3072, "sim_time": 30.0, "outer_updates": 2,
          "train_loss": 4.75})
  writer({"event": "eval", "tokens": 4096, "sim_time": 40.0, "outer_updates": 2,
          "val_loss": 4.5, "val_loss/en": 4.25})
  writer.close()
  scalars = read_scalars(str(tmp_path))
  assert scalars["val_loss"] == [(0, 5.5), (4096, 4.5)]
  assert scalars["val_loss/en"] == [(0, 5.25), (4096, 4.25)]
  assert scalars["val_loss_by_sim_second"] == [(0, 5.5), (40, 4.5)]
  assert scalars["arrival/staleness"] == [(1, 3.0)]
  assert scalars["heloco/lambda"] == [(1, 0.25)] and scalars["heloco/beta"] == [(1, 0.125)]
  assert scalars["heloco/branch_fraction/keep"] == [(1, 0.75)]
  assert scalars["arrival/rejected"] == [(1, 1.0)]
  assert scalars["train_loss"] == [(2048, 5.0), (3072, 4.75)]


@pytest.mark.parametrize("spec,error", [
    ("tensorboard", "jsonl \\(required\\)"), ("jsonl,wandb", "not allowed"),
])
def test_writers_key_errors_name_what_is_allowed(spec, error):
  with pytest.raises(ValueError, match=error):
    writers.parse(spec)


def test_default_writers_add_tensorboard_when_installed():
  assert writers.parse("") == ("jsonl", "tensorboard")
  assert writers.parse("jsonl") == ("jsonl",)


def test_the_cli_writes_event_files_beside_metrics_jsonl(tmp_path):
  from heloco_jax.cli import train
  from tests.cli.test_cli import TINY
  workdir = tmp_path / "run"
  assert train.main([f"--workdir={workdir}", *TINY, "--config.budget.tokens=2048"]) == 0
  scalars = read_scalars(str(workdir / "tensorboard"))
  evals = [r for r in map(json.loads, open(workdir / "metrics.jsonl"))
           if r["event"] == "eval"]
  assert [v for _, v in scalars["val_loss"]] == pytest.approx([r["val_loss"] for r in evals])
  assert len(scalars["arrival/staleness"]) > 0
  arrivals = [r for r in map(json.loads, open(workdir / "metrics.jsonl"))
              if r["event"] == "arrival"]
  assert scalars["train_loss"] == [(r["tokens"], pytest.approx(r["train_loss"]))
                                   for r in arrivals]
  assert train.main([f"--workdir={tmp_path / 'b'}", *TINY, "--config.budget.tokens=2048",
                     "--config.writers=jsonl"]) == 0
  assert not os.path.exists(tmp_path / "b" / "tensorboard")


def test_hj_simulate_takes_a_writer_as_on_row(tmp_path):
  import jax.numpy as jnp
  import numpy as np

  import heloco_jax as hj
  params = {"w": jnp.zeros((4,))}
  rng = np.random.default_rng(0)
  data = [[{"x": rng.normal(size=(8, 4)).astype(np.float32)} for _ in range(40)]
          for _ in range(3)]
  loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - 1.0) ** 2)
  writer = hj.TensorBoardWriter(str(tmp_path))
  hj.simulate(loss_fn, params, data, method="heloco", inner_steps=4, speeds=[1.0, 2.0, 3.0],
              budget=hj.Budget(steps=40, eval_every_steps=20),
              eval_fn=lambda p: loss_fn(p, data[0][0]), on_row=writer)
  writer.close()
  scalars = read_scalars(str(tmp_path))
  assert len(scalars["val_loss"]) >= 2 and "heloco/lambda" in scalars
