"""Checkpoint cost, measured side by side in one run.

1. Save and restore time of the quickstart's whole run state (HeLoCo, 5
   workers, 0.87M-parameter GPT: θ, momentum, 5 inner AdamW states and 5
   pending pseudo-gradients) through ``heloco_jax.rundir.checkpoint.Checkpointer``
   (one packed array per dtype) against orbax saving the same leaves one by
   one (``StandardSave`` of a flat dict), both synchronous, medians of
   ``--repeats`` alternating runs.
2. Run overhead: wall time of the quickstart's run (the CLI's engine,
   ``harness.engine_of_config``, writing a workdir) with ``checkpoint_every`` = 10
   (the default) against 0 (off), same process.

  python benchmarks/checkpoint.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

import jax
import orbax.checkpoint as ocp

import heloco_jax as hj
from heloco_jax.cli.configs import default
from heloco_jax.lm import harness
from heloco_jax.rundir import checkpoint


def _state() -> tuple[dict, dict]:
  """The quickstart's state after its first checkpoint (10 outer updates)."""
  config = default.get_config()
  captured = {}

  def on_checkpoint(engine):
    captured["state"] = engine.snapshot()
    engine.request_stop("one checkpoint")  # enough: one real mid-run state
  with tempfile.TemporaryDirectory() as root:  # checkpoints come with a workdir
    engine, _ = harness.engine_of_config(config, workdir=root)
    try:
      asyncio.run(engine.run(on_checkpoint=on_checkpoint))
    except hj.Stopped:
      pass
    finally:
      engine.close()
  return captured["state"]


def _timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def save_restore(repeats: int) -> None:
  arrays, meta = _state()
  leaves = jax.tree.leaves(arrays)
  size = sum(x.nbytes for x in leaves)
  print(f"state: {len(leaves)} arrays, {size / 2**20:.1f} MiB")
  with tempfile.TemporaryDirectory() as root:
    packed = checkpoint.Checkpointer(os.path.join(root, "packed"), keep=2)
    flat = {f"{i:05d}": leaf for i, leaf in enumerate(leaves)}
    per_leaf = ocp.CheckpointManager(
        os.path.join(root, "per_leaf"), options=ocp.CheckpointManagerOptions(
            max_to_keep=2, enable_async_checkpointing=False))
    times = {"packed save": [], "per-leaf save": [], "packed restore": [],
             "per-leaf restore": []}
    for step in range(repeats):
      times["packed save"].append(_timed(lambda: packed.save(step, arrays, meta)))
      times["per-leaf save"].append(_timed(lambda: per_leaf.save(
          step, args=ocp.args.StandardSave(flat))))
      times["packed restore"].append(_timed(lambda: packed.restore(lambda m: arrays)))
      times["per-leaf restore"].append(_timed(lambda: per_leaf.restore(
          step, args=ocp.args.StandardRestore(flat))))
    median = {name: statistics.median(values) for name, values in times.items()}
    for name, value in median.items():
      print(f"{name:18s} {value * 1e3:8.1f} ms")
    print(f"per-leaf / packed: save {median['per-leaf save'] / median['packed save']:.2f}x, "
          f"restore {median['per-leaf restore'] / median['packed restore']:.2f}x")


def run_overhead() -> None:
  walls = {}
  for every in (0, 10, 0, 10):  # alternating, the first pair also warms the compile cache
    config = default.get_config()
    config.checkpoint.every = every
    with tempfile.TemporaryDirectory() as root:
      engine, _ = harness.engine_of_config(config, workdir=root)  # checkpoints to root/checkpoints
      try:
        summary = asyncio.run(engine.run())
      finally:
        engine.close()
      walls[every] = summary["wall_seconds"]
  print(f"quickstart run: {walls[0]:.1f} s without checkpoints, {walls[10]:.1f} s with "
        f"checkpoint_every=10 (ratio {walls[10] / walls[0]:.3f})")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  save_restore(args.repeats)
  run_overhead()


if __name__ == "__main__":
  main()
