"""Tokens/s of the scanned inner loop vs a per-step jitted loop, and achieved FLOP/s.

Measured side by side in one run, on the same model (TinyGPT defaults unless
overridden) and batch:
  * per-step: one jitted AdamW step called H times from Python;
  * scanned: ``InnerLoop.run_jit``, H steps in one compiled call;
  * vmapped: ``InnerLoop.run_many`` with 4 workers stacked on a leading axis;
  * a 2048×2048 float32 matmul, as the machine's attainable FLOP/s.
Training FLOPs per token are counted as 6·N (N = non-embedding parameters)
plus 12·layers·context·d_model for attention (Kaplan et al. 2020).

  python benchmarks/inner_loop.py [--layers 8] [--batch 16] [--steps 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from heloco_jax.lm import model
from heloco_jax.training import inner


def _median_seconds(fn, repeats: int) -> float:
  fn()  # compile and warm up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--d-model", type=int, default=128)
  parser.add_argument("--context", type=int, default=128)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--steps", type=int, default=20, help="H, inner steps per call")
  parser.add_argument("--workers", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()

  config = model.ModelConfig(d_model=args.d_model, num_layers=args.layers, context=args.context)
  graphdef, params = model.init(config, seed=0)
  loop = inner.InnerLoop(functools.partial(model.loss, graphdef), inner.adamw())
  rng = np.random.default_rng(0)
  batches = jnp.asarray(rng.integers(0, 256, (args.steps, args.batch, args.context + 1)), jnp.int32)
  tokens_per_call = args.steps * args.batch * args.context
  key = jax.random.key(0)

  step = jax.jit(loop.step, donate_argnums=0)
  def per_step():
    state = loop.start(params)
    for batch in batches:
      state, _, _ = step(state, batch)
    jax.block_until_ready(state)

  def scanned():
    jax.block_until_ready(loop.run_jit(loop.start(params), batches, key))

  stack = lambda *xs: jnp.stack(xs)
  many_batches = jnp.stack([batches] * args.workers)
  keys = jax.random.split(key, args.workers)
  def vmapped():
    states = jax.tree.map(stack, *[loop.start(params)] * args.workers)
    jax.block_until_ready(loop.run_many(states, many_batches, keys, None))

  a = jnp.asarray(rng.normal(size=(2048, 2048)), jnp.float32)
  matmul = jax.jit(lambda x: x @ x)
  matmul_seconds = _median_seconds(lambda: jax.block_until_ready(matmul(a)), max(args.repeats, 5))
  peak = 2 * 2048 ** 3 / matmul_seconds

  non_embedding = model.num_params(params) - params["embed"]["embedding"].size - params["pos"].size
  flops_per_token = 6 * non_embedding + 12 * args.layers * args.context * args.d_model

  print(f"# jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()}); "
        f"GPT d_model {args.d_model}, {args.layers} layers, context {args.context}, "
        f"{model.num_params(params) / 1e6:.2f}M params; batch {args.batch}, H = {args.steps}; "
        f"median of {args.repeats}")
  print(f"large matmul (2048² f32): {peak / 1e9:8.1f} GFLOP/s")
  results = {}
  for name, fn, tokens in [("per-step jit", per_step, tokens_per_call),
                           ("scanned (1 worker)", scanned, tokens_per_call),
                           (f"vmapped ({args.workers} workers)", vmapped,
                            args.workers * tokens_per_call)]:
    seconds = _median_seconds(fn, args.repeats)
    results[name] = tokens / seconds
    achieved = results[name] * flops_per_token
    print(f"{name:22s} {results[name]:9.0f} tokens/s  {achieved / 1e9:7.1f} GFLOP/s "
          f"({achieved / peak:5.1%} of the matmul)")
  base = results["per-step jit"]
  for name, value in results.items():
    print(f"ratio {name} / per-step jit: {value / base:.2f}")


if __name__ == "__main__":
  main()
