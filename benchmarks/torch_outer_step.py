"""The HeLoCo authors' style of outer step in PyTorch: a Python loop over tensors.

Times ``torch_reference.HeLoCoServer.update`` (per tensor: norms and the dot
read back to Python with ``.item()``, the branch chosen in Python, then the
momentum and θ updated in place) on the TinyGPT-shaped tree of
``benchmarks/outer_step.py`` (vocabulary 50257, 14.5M parameters, 102
tensors), with pseudo-gradients that take every branch. It imports neither
jax nor heloco_jax (run it with the PyTorch environment's Python);
``benchmarks/all.py`` sets it against heloco_jax's jitted ``hj.heloco``.

  /tmp/torch_env/bin/python benchmarks/torch_outer_step.py [--repeats 20] [--device cpu|cuda]

The last line printed is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_reference import HeLoCoServer  # noqa: E402  pylint: disable=g-import-not-at-top


def tinygpt_shaped(vocab: int = 50257, d_model: int = 128, num_layers: int = 8,
                   context: int = 128) -> list[tuple[int, ...]]:
  """The tensor shapes of ``benchmarks.outer_step.tinygpt_shaped_tree`` (same count)."""
  d = d_model
  layer = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,),
           (4 * d, d), (d,)]
  return [(vocab, d), (context, d)] + layer * num_layers + [(d,), (d,), (d, vocab), (vocab,)]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--device", default="cpu")
  parser.add_argument("--threads", type=int, default=0, help="torch threads (0: its default)")
  args = parser.parse_args()
  if args.threads:
    torch.set_num_threads(args.threads)
  generator = torch.Generator().manual_seed(0)
  shapes = tinygpt_shaped()
  def normal():
    return [torch.randn(s, generator=generator).to(args.device) for s in shapes]
  server = HeLoCoServer(normal(), num_workers=5)
  drift = normal()
  deltas = [[d * scale + n for d, n in zip(drift, normal())] for scale in (1.0, -1.0, 0.1, 0.5)]
  sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
  for i in range(3):  # momentum becomes non-zero; every branch is reached
    server.update(deltas[i % 4])
  sync()
  times = []
  for i in range(args.repeats):
    start = time.perf_counter()
    server.update(deltas[i % 4])
    sync()
    times.append(time.perf_counter() - start)
  result = {"seconds_per_update": statistics.median(times), "tensors": len(shapes),
            "params": sum(int(torch.tensor(s).prod()) for s in shapes),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "device": args.device, "branch_counts": server.branch_counts}
  print(f"PyTorch per-tensor HeLoCo outer step: {result['seconds_per_update'] * 1e3:.2f} ms "
        f"per update ({result['tensors']} tensors, {result['params'] / 1e6:.2f}M parameters, "
        f"torch {result['torch']}, {result['threads']} threads, {args.device})")
  print("RESULT " + json.dumps(result))


if __name__ == "__main__":
  main()
