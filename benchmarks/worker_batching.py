"""A synchronous round's K workers vmapped vs one after another, side by side in one run.

For a flax.nnx CNN (BatchNorm, Dropout: the shape of flax's MNIST tutorial, 28×28 images)
and the quickstart's TinyGPT, at K = 2, 5 and 16 workers: DiLoCo's rounds through
``hj.simulate`` with ``hj.simulated_runtime(worker_batching="vmap")`` and ``"sequential"``,
timed from the end of the first round (compiled by then) to the end of the last, in seconds
per worker-step; and the ratio vmapped ÷ sequential (< 1: vmap is faster).
``simulated.AUTO_BATCHING`` (the default, "auto") follows what this prints per backend.

  python -m benchmarks.worker_batching [--rounds 4] [--workers 2,5,16] [--models cnn,tinygpt]
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
import optax

import heloco_jax as hj
from benchmarks import users_model
from heloco_jax.lm import model as tinygpt

H = 5


def _cnn_problem():
  # flax's MNIST tutorial CNN, with BatchNorm after each conv
  loss_fn, params, stats = users_model.engine_loss(users_model.TutorialCNN)

  def data(worker):
    rng = np.random.default_rng(worker)
    while True:
      yield (rng.normal(0, 1, (32, 28, 28, 1)).astype(np.float32),
             rng.integers(0, 10, 32).astype(np.int32))
  return loss_fn, params, data, {"model_state": stats}


def _gpt_problem():
  config = tinygpt.ModelConfig(context=128, d_model=128, num_layers=4, num_heads=4)  # quickstart
  graphdef, params = tinygpt.init(config, 0)

  def loss_fn(params, batch):
    return tinygpt.loss(graphdef, params, batch)

  def data(worker):
    rng = np.random.default_rng(worker)
    while True:
      yield rng.integers(0, 256, (8, 129)).astype(np.int32)  # the quickstart's batch
  return loss_fn, params, data, {}


def seconds_per_worker_step(problem, k: int, rounds: int, batching: str) -> float:
  loss_fn, params, data, extra = problem
  ends: list[float] = []

  def on_row(row):
    if row["event"] == "train":
      ends.append(time.perf_counter())
  hj.simulate(loss_fn, params, [data(i) for i in range(k)], method="diloco", inner_steps=H,
              speeds="homogeneous" if k != 5 else [1.0] * 5,
              budget=hj.Budget(steps=rounds * k * H),
              inner_tx=optax.adam(1e-3), on_row=on_row,
              metrics_fetch_every=1,  # each round's row fetched (and timed) as it ends
              runtime=hj.simulated_runtime(worker_batching=batching), **extra)
  return (ends[-1] - ends[0]) / ((len(ends) - 1) * k * H)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=4)
  parser.add_argument("--workers", default="2,5,16")
  parser.add_argument("--models", default="cnn,tinygpt")
  args = parser.parse_args()
  print(f"# jax {jax.__version__} on {jax.devices()[0].device_kind} "
        f"({jax.devices()[0].platform}), H = {H}, {args.rounds} rounds after the first")
  print(f"{'model':8} {'K':>3} {'vmap ms/worker-step':>20} {'sequential':>11} "
        f"{'vmap ÷ sequential':>18}")
  problems = {"cnn": _cnn_problem, "tinygpt": _gpt_problem}
  for name in args.models.split(","):
    problem = problems[name]()
    for k in map(int, args.workers.split(",")):
      vmapped = seconds_per_worker_step(problem, k, args.rounds + 1, "vmap")
      sequential = seconds_per_worker_step(problem, k, args.rounds + 1, "sequential")
      print(f"{name:8} {k:3d} {1e3 * vmapped:20.2f} {1e3 * sequential:11.2f} "
            f"{vmapped / sequential:18.2f}", flush=True)


if __name__ == "__main__":
  main()
