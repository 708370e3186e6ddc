"""Pods on this machine's host devices: the same run on ``runtime=devices`` (one process, every
device) and on Ray (one actor per device group), and a worker actor's recovery with and
without a hot spare (docs/BENCHMARKS.md, "Pods").

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.pods
      [--part=all|throughput|recovery --layers=4 --width=512 --repeats=2]

Throughput: HeLoCo, 2 workers of 4 devices each (each worker's batch of 32 split over its 4),
an MLP regression, 200 inner steps each way after an untimed warm-up; steps per second of
each and their ratio. Recovery: 2 workers on Ray, worker 1's actor process killed (SIGKILL)
right after its 3rd arrival; the seconds to its next arrival, restarted (Ray's
``max_restarts``: the new process imports, builds and compiles the inner loop) against a hot
spare (``ray.spares=1``: compiled on the first dispatch's inputs, it takes the workers at once).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import heloco_jax as hj


def _problem(layers: int, width: int, batch: int = 16):
  rng = np.random.default_rng(0)
  params = {f"w{i}": jnp.asarray(rng.normal(0, 1 / np.sqrt(width), (width, width)), jnp.float32)
            for i in range(layers)}

  def loss(params, batch):
    x, y = batch
    for i in range(layers):
      x = jnp.tanh(x @ params[f"w{i}"])
    return jnp.mean((x[:, :1] - y) ** 2)

  def stream(seed):
    rng = np.random.default_rng(seed)
    while True:
      x = rng.normal(0, 1, (batch, width)).astype(np.float32)
      yield x, np.tanh(x[:, :1])
  return loss, params, stream


def recovery_seconds(spares: int, layers: int, width: int) -> float:
  """Seconds from worker 1's actor killed (after its 3rd arrival) to its next arrival."""
  loss, params, stream = _problem(layers, width)
  engine = hj.make_engine(loss, params, [stream(0), stream(1)], method="heloco",
                          inner_tx=optax.sgd(0.01), inner_steps=4,
                          budget=hj.Budget(sim_seconds=300),  # stopped at the measurement
                          runtime=hj.ray_runtime(num_cpus=2, spares=spares),
                          metrics_fetch_every=1)  # each row reaches on_row as it happens
  executor = engine.runtime.executor
  seen, killed = {"arrivals": 0}, {}

  def on_row(row):
    if row.get("event") != "arrival" or row["worker"] != 1:
      return
    if "at" in killed and "back" not in killed:
      killed["back"] = time.perf_counter()
      engine.request_stop()
      return
    seen["arrivals"] += 1
    if seen["arrivals"] == 3:
      actor = executor._assigned[1]  # pylint: disable=protected-access
      os.kill(executor._pids[actor], signal.SIGKILL)  # pylint: disable=protected-access
      killed["at"] = time.perf_counter()
  try:
    asyncio.run(engine.run(on_row))
  except hj.Stopped:  # request_stop() at the measurement
    pass
  finally:
    engine.close()
  return killed["back"] - killed["at"]


def steps_per_second(runtime: Any, layers: int, width: int, steps: int = 200) -> float:
  """Inner steps per second of HeLoCo's 2 workers on ``runtime`` (after a warm-up run)."""
  loss, params, stream = _problem(layers, width, batch=32)
  options = dict(method="heloco", inner_tx=optax.sgd(0.01), inner_steps=10, runtime=runtime)
  hj.simulate(loss, params, [stream(0), stream(1)], budget=hj.Budget(steps=20), **options)
  result = hj.simulate(loss, params, [stream(0), stream(1)], budget=hj.Budget(steps=steps),
                       **options)
  return result.summary["steps"] / result.summary["wall_seconds"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", choices=("all", "throughput", "recovery"), default="all")
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--width", type=int, default=512)
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args()
  print(f"jax {jax.__version__}, {len(jax.devices())} {jax.devices()[0].platform} devices; "
        f"MLP {args.layers}×{args.width}²")
  if args.part in ("all", "throughput"):
    devices = steps_per_second(hj.devices_runtime(batch_size=32, group_sizes="4,4"),
                               args.layers, args.width)
    on_ray = steps_per_second(hj.ray_runtime(num_cpus=2, devices_per_worker=4),
                              args.layers, args.width)
    print(f"runtime=devices (one process, 2 groups of 4): {devices:.1f} steps/s")
    print(f"Ray (2 actors of 4 devices):                  {on_ray:.1f} steps/s")
    print(f"Ray ÷ devices: {on_ray / devices:.2f}")
  if args.part in ("all", "recovery"):
    cold = [recovery_seconds(0, args.layers, args.width) for _ in range(args.repeats)]
    warm = [recovery_seconds(1, args.layers, args.width) for _ in range(args.repeats)]
    print(f"kill -> next arrival, restarted actor (max_restarts): "
          f"{' '.join(f'{s:.2f}' for s in cold)} s")
    print(f"kill -> next arrival, hot spare (ray.spares=1):       "
          f"{' '.join(f'{s:.2f}' for s in warm)} s")
    print(f"restart ÷ spare (medians): {np.median(cold) / np.median(warm):.1f}×")


if __name__ == "__main__":
  main()
