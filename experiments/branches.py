"""HeLoCo's branch on Δ against its branch on the received D(C(Δ)), at the same arrivals.

Issue 34 asks how often HeLoCo's keep / shrink / rotate decision changes when its input is
quantized. Runs with a compressor follow their own trajectories, so their branch frequencies
(RESULTS.md, "HeLoCo's branches under compression") cannot say whether one decision changed.
Here one uncompressed HeLoCo run (the streaming grid's ``compression/fp32/heloco`` runs)
carries a shadow: at every arrival its outer rule also runs, from the same state, on what the
server would receive of that Δ under each compressor (``hj.compress.transmit``, a fresh
compressor state: no error-feedback residual, whose value depends on the history), and
counts per block the pair (branch on Δ, branch on D(C(Δ))). The shadow's results are thrown
away: the run itself is the fp32 run, bit for bit.

``python -m experiments.branches`` writes one digest per seed under
``experiments/results/streaming/branches/`` (about a minute each); the report reads them.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from experiments import grids
from heloco_jax import outer
from heloco_jax.cli.configs import default
from heloco_jax.comm import compress
from heloco_jax.lm import harness
from heloco_jax.outer import lookahead
from heloco_jax.training import methods

_HERE = os.path.dirname(os.path.abspath(__file__))
DIGESTS = os.path.join(_HERE, "results", "streaming", "branches")
# The streaming grid's compressors (grids.COMPRESSIONS) without error feedback.
SHADOWED = tuple({
    name.removesuffix("_ef"): {k: v for k, v in changes.items()
                               if k != "compression.error_feedback"}
    for name, changes in grids.COMPRESSIONS if name != "fp32"}.items())
NUM_BRANCHES = len(outer.BRANCH_NAMES)


class ShadowState(NamedTuple):
  """State of ``shadow_branches``.

  Attributes:
    inner: the wrapped rule's state (the run's own).
    pairs: int32[C, B, B]: blocks whose branch was b on Δ and b' on compressor c's D(C(Δ)).
  """
  inner: Any
  pairs: jax.Array


def shadow_branches(tx: optax.GradientTransformation,
                    compressors: Sequence[compress.Compressor]
                    ) -> optax.GradientTransformationExtraArgs:
  """``tx`` (holding a ``hj.heloco`` state) that also counts, per arrival and block, its
  branch on Δ against its branch on each compressor's D(C(Δ)) from the same state."""
  heloco_state = functools.partial(lookahead.find_state, types=(outer.HeLoCoState,),
                                   fn="shadow_branches")
  ids = jnp.arange(NUM_BRANCHES)

  def init_fn(params):
    return ShadowState(tx.init(params),
                       jnp.zeros((len(compressors), NUM_BRANCHES, NUM_BRANCHES), jnp.int32))

  def update_fn(updates, state, params=None, **extra_args):
    new_updates, inner = tx.update(updates, state.inner, params, **extra_args)
    branch = heloco_state(inner).info.branch
    pairs = []
    for c in compressors:
      received, _ = compress.transmit(c, updates, c.init(updates))
      _, shadow = tx.update(received, state.inner, params, **extra_args)
      shadow_branch = heloco_state(shadow).info.branch
      pairs.append(jnp.sum((branch[:, None, None] == ids[:, None])
                           & (shadow_branch[:, None, None] == ids[None, :]),
                           axis=0, dtype=jnp.int32))
    return new_updates, ShadowState(inner, state.pairs + jnp.stack(pairs))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def config_of(run: grids.Run, changes: Optional[dict[str, Any]] = None
              ) -> ml_collections.ConfigDict:
  """The CLI's config of ``run`` (its overrides, then ``changes``)."""
  config = default.get_config()
  for key, value in [*run.overrides, *(changes or {}).items()]:
    *path, leaf = key.split(".")
    setattr(functools.reduce(getattr, path, config), leaf, value)
  return config


def shadowed_engine(config: ml_collections.ConfigDict, compressors: Sequence[compress.Compressor],
                    dataset: Any = None) -> Any:
  """``harness.engine_of_config`` of ``config`` (a HeLoCo run) with its own outer rule shadowed
  (``shadow_branches``); the pairs are ``engine.outer_state.pairs`` after the run."""
  method = methods.get(config.method)
  rule = method.make_outer(config.num_workers, harness.outer_options(config))
  run_options = {key: value for key, value in harness.method_options(config).items()
                 if key in method.run_keys}  # the outer keys are the shadowed rule's
  engine, _ = harness.engine_of_config(config, dataset, outer_tx=shadow_branches(rule, compressors),
                                  method_options=run_options)
  return engine


def measure(seed: int) -> dict[str, Any]:
  """The shadowed fp32 HeLoCo run of the streaming grid's compression question."""
  run = next(r for r in grids.streaming_grid(seeds=(seed,))
             if r.name == f"streaming/compression/fp32/heloco/seed{seed}")
  config = config_of(run)
  engine = shadowed_engine(config, [harness.compressor(config_of(run, changes))
                                    for _, changes in SHADOWED])
  try:
    summary = asyncio.run(engine.run())
    pairs = np.asarray(jax.device_get(engine.outer_state.pairs))
  finally:
    engine.close()
  return {"run": run.name, "final_val_loss": summary["final_val_loss"],
          "arrivals": sum(1 for row in engine.rows if row["event"] == "arrival"),
          "pairs": {name: pairs[i].tolist() for i, (name, _) in enumerate(SHADOWED)}}


def load(digests: str = DIGESTS) -> list[dict[str, Any]]:
  if not os.path.isdir(digests):
    return []
  out = []
  for name in sorted(os.listdir(digests)):
    with open(os.path.join(digests, name)) as f:
      out.append(json.load(f))
  return out


def table(measured: Sequence[dict[str, Any]]) -> str:
  """Per compressor: the share of blocks whose branch changed, and the changes by kind."""
  if not measured:
    return ""
  names = outer.BRANCH_NAMES
  lines = ["| compressor | seeds | blocks | branch changed (mean over seeds, range) | "
           "the most common changes (on Δ → on D(C(Δ))) |", "|---|---|---|---|---|"]
  for name, _ in SHADOWED:
    per_seed = [np.asarray(m["pairs"][name]) for m in measured]
    shares = [1 - np.trace(p) / p.sum() for p in per_seed]
    total = np.sum(per_seed, axis=0)
    changes = [(total[a, b], f"{names[a]} → {names[b]}") for a in range(NUM_BRANCHES)
               for b in range(NUM_BRANCHES) if a != b and total[a, b]]
    common = ", ".join(f"{label} {count / total.sum():.2%}"
                       for count, label in sorted(changes, reverse=True)[:3]) or "none"
    lines.append(f"| {name} | {len(per_seed)} | {int(total.sum()):,} | "
                 f"{100 * np.mean(shares):.1f}% ({100 * min(shares):.1f}–{100 * max(shares):.1f}%)"
                 f" | {common} |")
  return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m experiments.branches",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--digests", default=DIGESTS)
  args = parser.parse_args(argv)
  os.makedirs(args.digests, exist_ok=True)
  for seed in (int(s) for s in args.seeds.split(",")):
    path = os.path.join(args.digests, f"seed{seed}.json")
    if os.path.exists(path):
      continue
    result = measure(seed)
    with open(path, "w") as f:
      json.dump(result, f, indent=1)
    print(f"branches: seed {seed}: {result['arrivals']} arrivals -> {path}", file=sys.stderr)
  print(table(load(args.digests)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
