"""First-run compilation of the quickstart config, cold and with the persistent cache.

Each case runs in a fresh subprocess: the quickstart (async HeLoCo, severe,
K = 5, H = 20, 4-layer GPT) for a budget of ``--arrivals`` arrivals, with
JAX's persistent compilation cache in a new directory. The first process
compiles everything (cold); the second finds the same programs in the cache
(warm). JAX's own monitoring events give the seconds spent tracing,
lowering and compiling (backend compile, or reading the cache); the wall
time to the first arrival row includes them.

  python -m benchmarks.compile_time [--arrivals 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _child(cache_dir: str, arrivals: int) -> None:
  import asyncio  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top

  from heloco_jax.cli import train  # pylint: disable=g-import-not-at-top
  from heloco_jax.cli.configs import default  # pylint: disable=g-import-not-at-top
  from heloco_jax.lm import harness  # pylint: disable=g-import-not-at-top
  start = time.perf_counter()
  train.use_compilation_cache(cache_dir)
  seconds: dict[str, float] = {}

  def listen(event: str, duration: float, **kwargs) -> None:
    del kwargs
    seconds[event] = seconds.get(event, 0.0) + duration
  jax.monitoring.register_event_duration_secs_listener(listen)
  config = default.get_config()
  config.budget.tokens = arrivals * config.inner_steps * config.batch_size * config.model.context
  config.budget.eval_every_tokens = 0
  config.metrics_fetch_every = 1  # a row per arrival as it happens, not 16 at a time
  first = []
  engine, _ = harness.engine_of_config(config)  # the CLI's engine of the config
  try:
    asyncio.run(engine.run(lambda row: first.append(time.perf_counter() - start)
                           if row["event"] == "arrival" and not first else None))
  finally:
    engine.close()
  name = lambda suffix: sum(v for k, v in seconds.items() if k.endswith(suffix))
  print(json.dumps({
      "backend_compile_s": name("backend_compile_duration"),
      "cache_read_s": name("cache_retrieval_time_sec"),
      "trace_and_lower_s": name("jaxpr_trace_duration") + name("jaxpr_to_mlir_module_duration"),
      "first_arrival_s": first[0], "wall_s": time.perf_counter() - start}))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--arrivals", type=int, default=2)
  parser.add_argument("--child", default="", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    _child(args.child, args.arrivals)
    return
  import jax  # pylint: disable=g-import-not-at-top
  print(f"# jax {jax.__version__} on {jax.devices()[0].device_kind}; quickstart config, "
        f"{args.arrivals} arrivals, each case in a fresh process")
  with tempfile.TemporaryDirectory() as cache_dir:
    results = {}
    for case in ("cold", "warm"):
      out = subprocess.run([sys.executable, "-m", "benchmarks.compile_time", f"--child={cache_dir}",
                            f"--arrivals={args.arrivals}"], capture_output=True, text=True,
                           check=True, cwd=os.path.dirname(os.path.dirname(__file__)) or ".")
      results[case] = r = json.loads(out.stdout.strip().splitlines()[-1])
      print(f"{case}: backend compile {r['backend_compile_s']:5.1f} s, cache reads "
            f"{r['cache_read_s']:4.1f} s, tracing + lowering {r['trace_and_lower_s']:4.1f} s; "
            f"first arrival at {r['first_arrival_s']:5.1f} s, run {r['wall_s']:5.1f} s")
    cold, warm = results["cold"], results["warm"]
    print(f"compile time, cold: {cold['backend_compile_s'] + cold['trace_and_lower_s']:.1f} s "
          f"(target < 30 s); first arrival warm / cold: "
          f"{warm['first_arrival_s'] / cold['first_arrival_s']:.2f}")
    print("RESULT " + json.dumps({"cold": cold, "warm": warm}))


if __name__ == "__main__":
  main()
