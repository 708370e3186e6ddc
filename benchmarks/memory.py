"""Per-device memory of a sharded run against the replicated layout, measured in one run.

The CLI's GPT at three sizes, FSDP-sharded (``heloco_jax.training.sharding.fsdp_specs``) over a mesh of
D = 1, 2, 4, 8 devices (host CPU devices here; the same code on GPUs or TPU chips), HeLoCo with
K = 2 workers on the simulated runtime through ``hj.make_engine``. After a few arrivals it
reads, from the live arrays' ``addressable_shards``, the bytes the fullest device holds for θ,
the outer state, the K workers' states and the in-flight pseudo-gradients, against the same
run with θ on one device (replicated: every device of a data-parallel layout holds all of it).
Also: the largest of these models whose run state fits a per-device budget, and the median
wall time between arrivals (after the first two, which compile) sharded / replicated.

  python -m benchmarks.memory [--budget_gib 16] [--sizes small,medium,large] [--fragments P]

With ``--fragments P`` θ syncs in P streaming fragments (each fragment's server holds its
leaves with θ's specs), and the workers' anchors (a θ each) count too.

``--pending K1,K2,...`` measures instead what each *pending* asynchronous worker costs
(docs/DESIGN.md, "Memory per worker"): HeLoCo with K simulated workers of an MLP on one
device, AdamW inside, a fresh optimizer per dispatch (the default), kept across dispatches
(``reset_optimizer=False``), and fresh with the pending starts in host memory
(``hj.simulated_runtime(pending_memory="pinned_host")``). Between the arrivals 1.5·K and 2·K
(every worker has arrived once and been sent again) it reads the bytes of every live JAX
array by memory kind (``jax.live_arrays``, each buffer once) and prints the device memory per
worker, in θs: the slope between consecutive K (what one more worker costs, the run's fixed
arrays cancelled) and the largest K whose pending workers fit ``--budget_gib`` beside θ and
the outer state for a model of ``--params`` parameters. (On a CPU both memory kinds are the
same RAM: the split shows where the arrays are, as an accelerator would hold them.)

  python -m benchmarks.memory --pending 16,64,256 [--budget_gib 20] [--params 25e6]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import jax  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
from jax.sharding import Mesh, NamedSharding  # pylint: disable=g-import-not-at-top

import heloco_jax as hj  # pylint: disable=g-import-not-at-top
from heloco_jax.lm import model as model_lib  # pylint: disable=g-import-not-at-top
from heloco_jax.training import sharding  # pylint: disable=g-import-not-at-top

SIZES = {"small": dict(d_model=64, num_layers=2), "medium": dict(d_model=128, num_layers=4),
         "large": dict(d_model=256, num_layers=4)}
CONTEXT, BATCH, K, H, VOCAB = 64, 8, 2, 2, 2048
PARTS = ("θ", "outer state", "worker states", "in-flight Δ", "anchors")


class Tokens:
  """Worker i's endless random token sequences (memory does not depend on the values)."""

  def __init__(self, worker):
    self.worker = worker

  def __iter__(self):
    rng = np.random.default_rng(self.worker)
    while True:
      yield rng.integers(0, VOCAB, (BATCH, CONTEXT + 1), dtype=np.int32)


def _fullest_device(tree) -> int:
  """Bytes of ``tree`` on the device that holds the most of it."""
  per_device: dict[int, int] = {}
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array):
      for shard in x.addressable_shards:
        per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
  return max(per_device.values(), default=0)


def _engine(size: str, devices: int, arrivals: int, fragments: int):
  config = model_lib.ModelConfig(vocab_size=VOCAB, context=CONTEXT, num_heads=4, **SIZES[size])
  graphdef, params = model_lib.init(config, seed=0)
  if devices > 1:
    mesh = Mesh(np.array(jax.devices()[:devices]), ("fsdp",))
    specs = sharding.fsdp_specs(params, "fsdp", devices)
    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
  # D = 1: everything on one device, as every device of a replicated layout holds it.
  runtime = hj.simulated_runtime(devices=jax.devices()[:1])
  return hj.make_engine(lambda p, batch: model_lib.loss(graphdef, p, batch), params,
                        [Tokens(i) for i in range(K)], method="heloco", inner_steps=H,
                        speeds=[1.0, 1.5], budget=hj.Budget(steps=arrivals * H), runtime=runtime,
                        streaming=hj.Streaming(fragments=fragments),
                        metrics_fetch_every=1)  # each arrival row as it happens


def measure(size: str, devices: int, fragments: int = 1) -> tuple[dict[str, int], float, int]:
  """(bytes on the fullest device per part, the most any arrival saw; the median wall
  seconds between arrivals after the first two (compilation); parameters)."""
  parts = dict.fromkeys(PARTS, 0)
  times = []
  engine = _engine(size, devices, arrivals=8 * fragments, fragments=fragments)
  try:
    def look(row):  # the live arrays, at every row: workers in flight, their pending Δ
      if row.get("event") != "arrival":
        return
      jax.block_until_ready(engine.params)
      times.append(time.perf_counter())
      s = engine.state
      now = {"θ": _fullest_device(engine.params),
             "outer state": _fullest_device(engine.outer_state),
             "worker states": _fullest_device(s.workers),
             "in-flight Δ": _fullest_device([job.delta for job in s.jobs.values()]),
             "anchors": _fullest_device(engine.features.streaming.anchors)}
      for part, value in now.items():
        parts[part] = max(parts[part], value)
    asyncio.run(engine.run(on_row=look))
    num_params = engine.num_params
  finally:
    engine.close()
  return parts, float(np.median(np.diff(times[2:]))), num_params


def _mlp(width: int = 256, depth: int = 3):
  """An MLP's parameters (depth layers width × width) and its squared-error loss."""
  keys = jax.random.split(jax.random.key(0), depth)
  params = {f"layer{i}": {"w": jax.random.normal(k, (width, width)) / width ** 0.5,
                          "b": jax.numpy.zeros(width)} for i, k in enumerate(keys)}

  def loss_fn(p, batch):
    x, y = batch
    for i in range(depth):
      x = jax.numpy.tanh(x @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"])
    return jax.numpy.mean((x - y) ** 2)
  return params, loss_fn


class Pairs:
  """Worker i's endless random (x, y) batches of 4 rows of the MLP's width."""

  def __init__(self, worker: int, width: int):
    self.worker, self.width = worker, width

  def __iter__(self):
    rng = np.random.default_rng(self.worker)
    while True:
      yield (rng.standard_normal((4, self.width), np.float32),
             rng.standard_normal((4, self.width), np.float32))


def _live_bytes() -> dict[str, int]:
  """Bytes of every live JAX array by memory kind ("device", "pinned_host"), each buffer once."""
  seen: dict[int, tuple[str, int]] = {}
  for x in jax.live_arrays():
    for shard in x.addressable_shards:
      seen[shard.data.unsafe_buffer_pointer()] = (str(x.sharding.memory_kind), shard.data.nbytes)
  by_kind: dict[str, int] = {}
  for kind, nbytes in seen.values():
    by_kind[kind] = by_kind.get(kind, 0) + nbytes
  return by_kind


def pending(k: int, reset_optimizer: bool, memory: str = "device", h: int = 2
            ) -> tuple[dict[str, int], int]:
  """(the most live bytes per memory kind between arrivals 1.5·K and 2·K, θ's bytes): HeLoCo,
  K workers, their pending starts in ``memory``."""
  params, loss_fn = _mlp()
  theta = sum(x.nbytes for x in jax.tree.leaves(params))
  rows, most = [0], {"device": 0, "pinned_host": 0}

  def look(row):
    if row.get("event") == "arrival":
      rows[0] += 1
      if 3 * k // 2 <= rows[0] <= 2 * k:
        live = _live_bytes()
        if live.get("device", 0) >= most["device"]:
          most.update(device=live.get("device", 0), pinned_host=live.get("pinned_host", 0))
  engine = hj.make_engine(loss_fn, params, [Pairs(i, 256) for i in range(k)], method="heloco",
                          inner_steps=h, speeds=[1.0 + 0.01 * i for i in range(k)],
                          budget=hj.Budget(steps=2 * k * h), reset_optimizer=reset_optimizer,
                          runtime=hj.simulated_runtime(devices=jax.devices()[:1],
                                                       pending_memory=memory),
                          metrics_fetch_every=1)
  try:
    asyncio.run(engine.run(on_row=look))
  finally:
    engine.close()
  del engine
  return most, theta


PENDING_SETUPS = {"fresh": (True, "device"), "kept": (False, "device"),
                  "fresh, starts in pinned_host": (True, "pinned_host")}


def main_pending(ks: list[int], budget_gib: float, model_params: float) -> None:
  print(f"HeLoCo, K pending workers of a {sum(x.size for x in jax.tree.leaves(_mlp()[0])):,}-"
        "parameter MLP on one device, AdamW inside, H = 2; live bytes between arrivals 1.5·K "
        "and 2·K, by memory kind\n")
  print("| inner optimizer per dispatch | K | device memory | host memory | device per worker "
        "(θ) | slope from the K before (device, θ per worker) |")
  print("|---|---|---|---|---|---|")
  slopes = {}
  for name, (reset, memory) in PENDING_SETUPS.items():
    before = None
    for k in ks:
      live, theta = pending(k, reset, memory)
      device = live["device"]
      slope = "" if before is None else f"{(device - before[1]) / (k - before[0]) / theta:.3f}"
      if before is not None:
        slopes[name] = (device - before[1]) / (k - before[0]) / theta
      print(f"| {name} | {k} | {device / 2**20:.1f} MiB | {live['pinned_host'] / 2**20:.1f} MiB"
            f" | {device / k / theta:.3f} | {slope} |")
      before = (k, device)
  theta = model_params * 4
  budget = budget_gib * 2**30
  print(f"\nLargest K whose pending workers fit {budget_gib:g} GiB of device memory beside θ "
        f"and HeLoCo's momentum, a {model_params / 1e6:g}M-parameter float32 model "
        "(activations not counted), at the last slope:")
  for name, slope in slopes.items():
    fits = "any K (nothing per worker)" if slope <= 0.01 else (
        f"K = {int((budget - 2 * theta) // (slope * theta))}")
    print(f"  {name}: {fits} ({slope:.3f} θ per worker)")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--budget_gib", type=float, default=16.0,
                      help="per-device memory budget for the 'largest model that fits' line")
  parser.add_argument("--sizes", default="small,medium,large")
  parser.add_argument("--fragments", type=int, default=1, help="streaming fragments P")
  parser.add_argument("--pending", default="",
                      help="K1,K2,...: bytes per pending asynchronous worker instead")
  parser.add_argument("--params", type=float, default=25e6,
                      help="with --pending: the model size of the 'largest K' line")
  args = parser.parse_args()
  if args.pending:
    main_pending([int(k) for k in args.pending.split(",")], args.budget_gib, args.params)
    return
  print(f"{jax.device_count()} {jax.devices()[0].platform} devices; HeLoCo, K={K}, "
        f"H={H}, P={args.fragments}, batch {BATCH}×{CONTEXT}; bytes on the fullest device\n")
  print(f"| model | D | {' | '.join(PARTS)} | total | replicated total | ratio | 1/D + 5% "
        "| s/arrival sharded / replicated |")
  print("|---|---|" + "---|" * (len(PARTS) + 5))
  per_param = {}
  for size in args.sizes.split(","):
    replicated, replicated_seconds, num_params = measure(size, 1, args.fragments)
    total_replicated = sum(replicated.values())
    per_param[size] = (num_params, total_replicated / num_params)
    for d in (1, 2, 4, 8):
      parts, seconds, _ = (replicated, replicated_seconds, num_params) if d == 1 else measure(
          size, d, args.fragments)
      total = sum(parts.values())
      ratio = total / total_replicated
      goal = "holds" if ratio <= 1 / d + 0.05 else "misses"
      print(f"| {size} ({num_params / 1e6:.2f}M) | {d} | "
            + " | ".join(f"{parts[p] / 2**20:.2f} MiB" for p in PARTS)
            + f" | {total / 2**20:.2f} MiB | {total_replicated / 2**20:.2f} MiB | {ratio:.3f} | "
            f"{1 / d + 0.05:.3f} ({goal}) | {seconds / replicated_seconds:.2f} |")
  budget = args.budget_gib * 2**30
  print(f"\nLargest model whose run state fits {args.budget_gib:g} GiB per device "
        "(bytes per parameter as measured, activations not counted):")
  for d in (1, 2, 4, 8):
    bytes_per_param = min(b for _, b in per_param.values())
    print(f"  D={d}: {budget * d / bytes_per_param / 1e9:.2f}B parameters "
          f"({bytes_per_param:.1f} bytes per parameter replicated)")


if __name__ == "__main__":
  main()
