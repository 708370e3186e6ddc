"""Simulator overhead and scaling, measured side by side in one run.

1. Overhead: steady-state tokens/s of a full asynchronous HeLoCo simulation
   (severe preset, quickstart model and batch, H = 20) ÷ tokens/s of the bare
   compiled inner loop (``InnerLoop.run_jit`` on the same shapes, back to back).
   Both are timed after compilation: the simulation from its first to its last
   arrival (eval rows excluded by turning periodic evals off), the bare loop
   over the same number of dispatches.
2. Scaling: wall time and peak RSS of a HeLoCo simulation at a fixed token
   budget for K = 5, 16 and 64 workers, each K in a fresh subprocess; and the
   same run (K = 5) on 1, 2, ... host CPU devices (``host_devices``: the
   simulated runtime spreads in-flight workers over them).

  python benchmarks/simulator_overhead.py [--dispatches 40] [--scale-tokens 400000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from heloco_jax.cli.configs import default
from heloco_jax.lm import harness


def _config(num_workers: int, tokens: int):
  config = default.get_config()
  config.num_workers = num_workers
  config.budget.tokens = tokens
  config.budget.eval_every_tokens = 0  # only the initial and final evals
  return config


def overhead(dispatches: int) -> dict:
  """Tokens/s of the simulation and of the bare loop; prints them and returns them."""
  config = _config(5, 0)
  tokens_per_dispatch = config.inner_steps * config.batch_size * config.model.context
  config.budget.tokens = (dispatches + 1) * tokens_per_dispatch
  arrivals: list[tuple[float, int]] = []
  engine, problem = harness.engine_of_config(config)  # the CLI's engine of the config
  update = engine.server.update

  def timed_update(*args, **kwargs):  # when each outer update is applied (rows are
    out = update(*args, **kwargs)     # fetched in batches, so on_row would time those)
    arrivals.append((time.perf_counter(), engine.units))
    return out
  engine.server.update = timed_update
  try:
    asyncio.run(engine.run())
  finally:
    engine.close()
  (t0, tokens0), (t1, tokens1) = arrivals[0], arrivals[-1]
  simulated = (tokens1 - tokens0) / (t1 - t0)

  loop = engine.runtime.executor.inner
  worker_batches = iter(problem.data.worker_iterator(0))
  batches = jnp.asarray(np.stack([next(worker_batches) for _ in range(config.inner_steps)]))
  state = loop.start(engine.params)
  state, _ = loop.run_jit(state, batches, jax.random.key(0))  # compile
  jax.block_until_ready(state)
  start = time.perf_counter()
  for _ in range(len(arrivals) - 1):
    state, _ = loop.run_jit(state, batches, jax.random.key(0))
  jax.block_until_ready(state)
  bare = (len(arrivals) - 1) * tokens_per_dispatch / (time.perf_counter() - start)
  print(f"# jax {jax.__version__} on {jax.devices()[0].device_kind}; quickstart model "
        f"({engine.num_params / 1e6:.2f}M params), batch {config.batch_size}, "
        f"H = {config.inner_steps}, severe preset, {len(arrivals)} arrivals")
  print(f"bare compiled inner loop  {bare:9.0f} tokens/s")
  print(f"async HeLoCo simulation   {simulated:9.0f} tokens/s")
  print(f"ratio simulation / bare   {simulated / bare:9.3f}  (target >= 0.9)")
  return {"simulation_tokens_per_second": simulated, "bare_tokens_per_second": bare,
          "ratio": simulated / bare, "arrivals": len(arrivals)}


def scale_one(num_workers: int, tokens: int) -> None:
  """Child process: one simulation; prints JSON with wall time and peak RSS."""
  from heloco_jax.cli import train  # pylint: disable=g-import-not-at-top
  train.use_compilation_cache(train.default_cache_dir())  # as the CLI: warm after one run
  start = time.perf_counter()
  engine, _ = harness.engine_of_config(_config(num_workers, tokens))
  try:
    summary = asyncio.run(engine.run())
  finally:
    engine.close()
  print(json.dumps({"K": num_workers, "wall_seconds": time.perf_counter() - start,
                    "tokens": summary["tokens"], "outer_updates": summary["outer_updates"],
                    "tokens_per_second": summary["tokens_per_second"],
                    "devices": jax.device_count(), "peak_rss_mb": _peak_rss_mb()}))


def _peak_rss_mb() -> float:
  """This process's peak RSS: VmHWM, which (unlike ru_maxrss) a parent's does not inflate."""
  try:
    with open("/proc/self/status") as f:
      return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
  except (OSError, StopIteration):
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dispatches", type=int, default=40)
  parser.add_argument("--scale-tokens", type=int, default=400_000)
  parser.add_argument("--workers", type=int, nargs="+", default=[5, 16, 64])
  parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    scale_one(args.child, args.scale_tokens)
    return
  overhead(args.dispatches)
  scaling(args.workers, args.scale_tokens)


def _child(num_workers: int, tokens: int, env: Optional[dict] = None) -> dict:
  """``scale_one``'s result, from a fresh process (with ``env``, else this one's)."""
  out = subprocess.run([sys.executable, __file__, f"--child={num_workers}",
                        f"--scale-tokens={tokens}"], capture_output=True, text=True,
                       check=True, env=env).stdout
  return json.loads(out.strip().splitlines()[-1])


def host_devices(counts: list[int], tokens: int) -> list[dict]:
  """The K = 5 run on n host CPU devices for each n (fresh processes); prints and returns."""
  print(f"\nhost CPU devices at {tokens} tokens (HeLoCo, K = 5, severe preset; "
        f"{os.cpu_count()} cores):")
  base, results = None, []
  for n in counts:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")
    for _ in range(2):  # the second run is timed from a warm compilation cache
      result = _child(5, tokens, env)
    base = base or result["tokens_per_second"]
    result["ratio"] = result["tokens_per_second"] / base
    results.append(result)
    print(f"{n} device(s): {result['tokens_per_second']:8.0f} tokens/s ({result['ratio']:.2f}x), "
          f"wall {result['wall_seconds']:.1f} s")
  return results


def scaling(workers: list[int], tokens: int) -> list[dict]:
  """Wall time and peak RSS per K, each in a fresh process; prints and returns them."""
  print(f"\nscaling at {tokens} tokens (HeLoCo, severe preset cycled over K):")
  base, results = None, []
  for k in workers:
    result = _child(k, tokens)
    base = base or result["wall_seconds"]
    result["ratio"] = result["wall_seconds"] / base
    results.append(result)
    print(f"K = {k:3d}: {result['wall_seconds']:6.1f} s ({result['ratio']:.2f}x), "
          f"peak RSS {result['peak_rss_mb']:7.0f} MB, {result['outer_updates']} outer updates")
  return results


if __name__ == "__main__":
  main()
