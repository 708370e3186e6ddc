"""Time one compiled outer update of heloco, mla and async_nesterov, and of heloco and mla
with the server's packed layout (``OuterServer(packed=True)``: θ and the state in one
buffer per dtype, each Δ packed, then the step; docs/ALGORITHMS.md "Packed outer state").

The pytree is shaped like TinyGPT (d_model 128, 8 layers, context 128,
untied head) with vocabulary 50257 (~14.5M parameters) and 256. Each rule
is jitted with its params and state donated (as a server would run it),
warmed up, then timed over interleaved repeats so that machine noise hits
all rules alike. Prints the median time per update and the ratios.

  python benchmarks/outer_step.py [--repeats 30] [--vocab 50257 256]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import heloco_jax as hj
from heloco_jax.outer import packing
from heloco_jax.training import server


def tinygpt_shaped_tree(vocab: int, d_model: int = 128, num_layers: int = 8,
                        context: int = 128, seed: int = 0) -> dict:
  """Random float32 arrays with the shapes of a TinyGPT's parameters."""
  rng = np.random.default_rng(seed)
  arr = lambda *shape: jnp.asarray(rng.normal(size=shape) * 0.02, jnp.float32)
  layer = lambda: {
      "ln1": {"scale": arr(d_model), "bias": arr(d_model)},
      "attn": {"qkv": arr(d_model, 3 * d_model), "qkv_bias": arr(3 * d_model),
               "out": arr(d_model, d_model), "out_bias": arr(d_model)},
      "ln2": {"scale": arr(d_model), "bias": arr(d_model)},
      "mlp": {"up": arr(d_model, 4 * d_model), "up_bias": arr(4 * d_model),
              "down": arr(4 * d_model, d_model), "down_bias": arr(d_model)},
  }
  return {"embed": arr(vocab, d_model), "pos": arr(context, d_model),
          "layers": [layer() for _ in range(num_layers)],
          "ln_f": {"scale": arr(d_model), "bias": arr(d_model)},
          "head": arr(d_model, vocab), "head_bias": arr(vocab)}


def time_rules(vocab: int, repeats: int, num_workers: int = 5) -> dict[str, float]:
  params = tinygpt_shaped_tree(vocab)
  rng = np.random.default_rng(1)
  drift = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
  # Distinct pseudo-gradients so heloco takes every branch, not one cached path.
  deltas = [jax.tree.map(lambda d, x: d * s + jnp.asarray(rng.normal(size=x.shape), jnp.float32),
                         drift, params) for s in (1.0, -1.0, 0.1, 0.5)]
  rules = {
      "heloco": hj.heloco(num_workers=num_workers),
      "mla": hj.mla(num_workers=num_workers),
      "async_nesterov": hj.async_nesterov(num_workers=num_workers),
      "heloco_tree": hj.heloco(num_workers=num_workers, scope="tree"),
      "delayed_nesterov": hj.delayed_nesterov(0.07, num_workers=num_workers),
  }
  packed = {"heloco_packed": rules["heloco"], "mla_packed": rules["mla"]}
  pack = jax.jit(packing.pack)  # a packed server packs each Δ once, then steps
  steps, states, current = {}, {}, {}
  for name, tx in {**rules, **packed}.items():
    step = server.jit_outer_step(tx)
    steps[name] = ((lambda p, s, d, t, step=step: step(p, s, pack(d), t)) if name in packed
                   else step)
    current[name] = packing.pack(params) if name in packed else jax.tree.map(jnp.copy, params)
    states[name] = tx.init(current[name])
    for i in range(3):  # compile and warm up; momentum becomes non-zero
      current[name], states[name] = steps[name](current[name], states[name],
                                                deltas[i % 4], jnp.int32(i))
    jax.block_until_ready(current[name])
  samples = {name: [] for name in steps}
  for r in range(repeats):
    for name in steps:
      t0 = time.perf_counter()
      current[name], states[name] = steps[name](current[name], states[name],
                                                deltas[r % 4], jnp.int32(r % 7))
      jax.block_until_ready((current[name], states[name]))
      samples[name].append(time.perf_counter() - t0)
  return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=30)
  parser.add_argument("--vocab", type=int, nargs="+", default=[50257, 256])
  args = parser.parse_args()
  print(f"# jax {jax.__version__}, device {jax.devices()[0].device_kind} "
        f"({jax.default_backend()}), {platform.processor() or platform.machine()}, "
        f"{repeats_note(args.repeats)}")
  for vocab in args.vocab:
    n = sum(x.size for x in jax.tree.leaves(tinygpt_shaped_tree(vocab)))
    medians = time_rules(vocab, args.repeats)
    print(f"\nvocab {vocab}: {n / 1e6:.2f}M parameters, {len(jax.tree.leaves(tinygpt_shaped_tree(vocab)))} leaves")
    for name, seconds in medians.items():
      print(f"  {name:18s} {seconds * 1e3:9.3f} ms / update")
    print(f"  ratio heloco/mla            {medians['heloco'] / medians['mla']:.3f}  (target <= 1.5)")
    print(f"  ratio heloco/async_nesterov {medians['heloco'] / medians['async_nesterov']:.3f}")
    for name in ("heloco", "mla"):
      print(f"  {name} tree ÷ packed          "
            f"{medians[name] / medians[name + '_packed']:.3f}  (> 1: packed is faster)")


def repeats_note(repeats: int) -> str:
  return f"median of {repeats} interleaved repeats, params and state donated"


if __name__ == "__main__":
  main()
