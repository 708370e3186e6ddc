"""HeLoCo's per-leaf sums on the packed server, three ways, and the packed step with each.

``packing.leaf_sums`` ([⟨Δ, m⟩, |Δ|², |m|²] per leaf from the ``[rows, 1024]`` buffers) sums
each leaf's rows as a static contiguous slice. This times it beside the two other ways to
sum rows onto leaves: ``jax.ops.segment_sum`` (a scatter; what the packed server used before
2026-12-04) and a one-hot matrix product (``[rows, 3]ᵀ · [rows, leaves]``, at float32's full
precision), then the packed HeLoCo step with each (the rest of the step unchanged) and the
packed MLA step, side by side in one run, median ms of 15 samples of 3 calls each. The tree
is device_step.py's GPT (86M parameters, 138 leaves; ``--small``: its CPU size).

  python benchmarks/leaf_sums.py [--small]
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import heloco_jax as hj
from heloco_jax.outer import packing
from heloco_jax.training import server

try:
  from benchmarks import device_step
except ImportError:  # run as a script: benchmarks/ is on sys.path
  import device_step


def scatter_sums(delta: Any, momentum: Any, cast: Callable[[Any], Any]) -> jax.Array:
  layout = delta.layout
  return sum(jax.ops.segment_sum(packing.rows_dot(cast(d), cast(m)), rows,
                                 num_segments=layout.num_leaves, indices_are_sorted=True)
             for d, m, rows in zip(delta.buffers, momentum.buffers, layout.row_leaf))


def one_hot_sums(delta: Any, momentum: Any, cast: Callable[[Any], Any]) -> jax.Array:
  layout = delta.layout
  total = 0.0
  for d, m, rows in zip(delta.buffers, momentum.buffers, layout.row_leaf):
    sums = packing.rows_dot(cast(d), cast(m))
    hot = (jnp.asarray(rows)[:, None] == jnp.arange(layout.num_leaves)).astype(sums.dtype)
    total = total + jnp.einsum("rk,rl->lk", sums, hot, precision=jax.lax.Precision.HIGHEST)
  return total


WAYS = {"slices": packing.leaf_sums, "scatter": scatter_sums, "one_hot": one_hot_sums}


def median_ms(call: Callable[[int], Any], samples: int = 15, chain: int = 3) -> float:
  times = []
  for r in range(samples + 2):  # 2 warm-up samples (the first compiles)
    t0 = time.perf_counter()
    for c in range(chain):
      out = call(r * chain + c)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / chain)
  return statistics.median(times[2:]) * 1e3


def main(argv: list[str]) -> None:
  sizes = {"tree": "model", "vocab": 257,
           **(device_step.SMALL if "--small" in argv else device_step.FULL)}
  params = device_step._outer_tree(sizes)  # pylint: disable=protected-access
  leaves, treedef = jax.tree.flatten(params)
  deltas = [jax.tree.unflatten(treedef, [jax.random.normal(jax.random.key(100 * k + i), x.shape)
                                         for i, x in enumerate(leaves)]) for k in range(4)]
  pack = jax.jit(packing.pack)
  d, m = pack(deltas[0]), pack(deltas[1])
  print(f"# {jax.devices()[0].device_kind}; {sum(x.size for x in leaves) / 1e6:.2f}M "
        f"parameters, {len(leaves)} leaves, {d.buffers[0].shape[0]} rows of {packing.BLOCK}")
  to_f32 = lambda x: x.astype(jnp.float32)
  want = np.asarray(packing.leaf_sums(d, m, to_f32), np.float64)
  for name, way in WAYS.items():
    sums = jax.jit(lambda a, b, way=way: way(a, b, to_f32))
    error = np.max(np.abs(np.asarray(sums(d, m)) - want) / (np.abs(want) + 1e-30))
    print(f"leaf sums, {name:8s} {median_ms(lambda i: sums(d, m)):8.3f} ms   "
          f"max relative difference from slices {error:.1e}", flush=True)
  original = packing.leaf_sums
  try:
    for rule, ways in (("heloco", list(WAYS)), ("mla", ["slices"])):
      for name in ways:
        packing.leaf_sums = WAYS[name]  # read at trace time by the correction and the server
        tx = getattr(hj, rule)(num_workers=5)
        step = server.jit_outer_step(tx)
        theta = pack(jax.tree.map(jnp.copy, params))
        current = [theta, tx.init(theta)]
        def call(i, step=step, current=current):
          current[:] = step(*current, pack(deltas[i % 4]), jnp.int32(i % 7))
          return current
        label = f"{rule}, {name}" if rule == "heloco" else rule
        print(f"packed step (Δ packed, then the step), {label:16s} {median_ms(call):8.3f} ms",
              flush=True)
  finally:
    packing.leaf_sums = original


if __name__ == "__main__":
  main(sys.argv[1:])
