"""Batches/s of one worker's grain iterator (context 128, batch 16) per partition.

  python benchmarks/data_pipeline.py [--batches 20000]
"""

from __future__ import annotations

import argparse
import time

from heloco_jax.lm import data


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", type=int, default=20_000)
  args = parser.parse_args()
  for partition in ("non_iid", "iid", "dirichlet"):
    ds = data.make_data(partition=partition, dirichlet_alpha=0.5, context=128, batch_size=16)
    iterator = ds.worker_iterator(0)
    next(iterator)
    start = time.perf_counter()
    for _ in range(args.batches):
      next(iterator)
    rate = args.batches / (time.perf_counter() - start)
    print(f"{partition:10s} {rate:9.0f} batches/s of (16, 129)")


if __name__ == "__main__":
  main()
