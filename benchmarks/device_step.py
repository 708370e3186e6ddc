"""On an accelerator: inner-loop MFU of a 125M GPT and outer-step memory bandwidth.

1. Inner loop: the project's own GPT (``heloco_jax.lm.model``) at GPT-2-small
   size (d_model 768, 12 layers, 12 heads, context 1024; byte vocabulary 257
   unless ``--vocab``), H AdamW steps per ``InnerLoop.run_jit`` call, timed
   after a warm-up compile (median of repeats, each call's state fed to the
   next, ``block_until_ready``). Model FLOPs per token follow PaLM
   (Chowdhery et al. 2022, appendix B):
     6·N + 12·L·d_model·T
   with N the non-embedding parameters (all but the token and position
   embeddings; the untied head is a matmul and counts), L layers and T the
   context; the attention term counts the full T×T score matrix, causal or
   not, and rematerialisation is not counted (MFU, not HFU). Achieved FLOP/s
   = FLOPs per token × tokens/s; MFU = achieved / the device's dense peak
   for the dtype the matmuls run in (the model computes in float32; at JAX's
   default matmul precision that is TF32 on NVIDIA Ampere and later and one
   bf16 pass on TPU), from a table of known devices or ``--peak-tflops``.
2. Outer step: heloco and mla on the same params tree (the GPT above, or
   with ``--tree small`` the ~14.5M tree of benchmarks/outer_step.py), each
   jitted with params and state donated, timed over interleaved repeats.
   Bytes per update are a lower bound counted from the actual pytrees (the
   ``nbytes`` of their leaves): read θ, Δ and every state leaf, write θ and
   every state leaf. HeLoCo's per-block coefficients need reductions over
   Δ and m before the update pass, so a second estimate adds one more read
   of Δ and m for it. Achieved GB/s = bytes / median time per update, also
   as a fraction of the device's peak HBM bandwidth when known. Both rules
   run again, interleaved, on the same numbers packed into one flat leaf
   (``ravel_pytree``): tree ÷ flat is what the tree's leaves cost.

Prints the device, the jax version and every measured number, then one line
``RESULT {json}`` with all of them. On a CPU without ``--small`` the sizes
fall back to ``--small`` (a quick smoke run), and the output says so.

  python benchmarks/device_step.py [--small] [--batch 8] [--steps 10] [--repeats 5]
      [--vocab 257] [--tree model|small] [--peak-tflops T] [--peak-hbm-gbs B]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

import heloco_jax as hj
from heloco_jax.outer import packing
from heloco_jax.lm import model as model_lib
from heloco_jax.training import inner, server

try:  # python -m benchmarks.device_step
  from benchmarks.outer_step import tinygpt_shaped_tree
except ImportError:  # python benchmarks/device_step.py
  from outer_step import tinygpt_shaped_tree

# Defaults of the full (GPT-2 small) and --small runs; explicit flags win.
FULL = dict(d_model=768, layers=12, heads=12, context=1024, batch=8, steps=10,
            vocab=model_lib.BYTE_VOCAB_SIZE, tree="model", repeats=5, outer_repeats=20, chain=5)
SMALL = dict(d_model=128, layers=2, heads=4, context=128, batch=2, steps=2,
             vocab=model_lib.BYTE_VOCAB_SIZE, tree="small", repeats=3, outer_repeats=5, chain=2)

# Dense peaks per device (FLOP/s by matmul dtype; HBM bytes/s), matched by
# lower-cased substrings of device_kind, the first entry whose substrings all
# occur wins (so the specific entries come first). Vendor datasheet numbers,
# without sparsity.
PEAKS = [
    (("h100", "pcie"), "H100 PCIe", dict(bf16=756e12, tf32=378e12, fp32=51.2e12), 2.0e12),
    (("h100",), "H100 SXM", dict(bf16=989e12, tf32=494.7e12, fp32=66.9e12), 3.35e12),
    # GH200 ships with 4.0 or 4.9 TB/s memory: no HBM entry, pass --peak-hbm-gbs.
    (("gh200",), "GH200", dict(bf16=989e12, tf32=494.7e12, fp32=66.9e12), None),
    (("h200",), "H200 SXM", dict(bf16=989e12, tf32=494.7e12, fp32=66.9e12), 4.8e12),
    (("a100", "40gb"), "A100 40GB", dict(bf16=312e12, tf32=156e12, fp32=19.5e12), 1.555e12),
    (("a100",), "A100 80GB", dict(bf16=312e12, tf32=156e12, fp32=19.5e12), 2.0e12),
    (("tpu v4",), "TPU v4", dict(bf16=275e12), 1.2e12),
    (("tpu v5 lite",), "TPU v5e", dict(bf16=197e12), 0.82e12),
    (("tpu v5e",), "TPU v5e", dict(bf16=197e12), 0.82e12),
    (("tpu v5",), "TPU v5p", dict(bf16=459e12), 2.76e12),
    (("tpu v6",), "TPU v6e (Trillium)", dict(bf16=918e12), 1.64e12),
    (("trillium",), "TPU v6e (Trillium)", dict(bf16=918e12), 1.64e12),
]


def device_peaks(device_kind: str) -> tuple[Optional[str], dict, Optional[float]]:
  """(table name, FLOP/s peaks by dtype, HBM bytes/s) of a device; (None, {}, None) if unknown."""
  kind = device_kind.lower()
  for substrings, name, flops, hbm in PEAKS:
    if all(s in kind for s in substrings):
      return name, flops, hbm
  return None, {}, None


def matmul_peak_key(platform: str, dtype: Any) -> tuple[Optional[str], str]:
  """Which peak applies to matmuls of ``dtype`` at JAX's configured precision, and why."""
  precision = jax.config.jax_default_matmul_precision
  if jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
    return "bf16", f"{jnp.dtype(dtype).name} matmuls"
  if precision in (None, "default", "fastest", "bfloat16"):
    if platform == "gpu":
      return "tf32", "float32 at default precision: TF32 tensor cores"
    if platform == "tpu":
      return "bf16", "float32 at default precision: one bf16 MXU pass"
    return None, "float32"
  if precision in ("highest", "float32") and platform == "gpu":
    return "fp32", f"float32 at precision {precision!r}"
  if precision in ("high", "tensorfloat32", "bfloat16_3x") and platform == "gpu":
    return "tf32", f"float32 at precision {precision!r}"
  return None, f"float32 at precision {precision!r} (multi-pass; no table peak)"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--small", action="store_true",
                      help="quick smoke sizes (d_model 128, 2 layers, context 128, batch 2, "
                           "H 2, tree small); automatic on CPU")
  parser.add_argument("--d-model", type=int)
  parser.add_argument("--layers", type=int)
  parser.add_argument("--heads", type=int)
  parser.add_argument("--context", type=int)
  parser.add_argument("--vocab", type=int, help="vocabulary size (default 257, bytes + BOS)")
  parser.add_argument("--batch", type=int, help="sequences per inner step")
  parser.add_argument("--steps", type=int, help="H, inner steps per run_jit call")
  parser.add_argument("--repeats", type=int, help="timed run_jit calls")
  parser.add_argument("--tree", choices=("model", "small"),
                      help="outer-step tree: the GPT's params, or outer_step.py's ~14.5M tree")
  parser.add_argument("--outer-repeats", type=int, help="timed samples per outer rule")
  parser.add_argument("--chain", type=int, help="outer updates per timed sample")
  parser.add_argument("--num-workers", type=int, default=5, help="K of the outer rules")
  parser.add_argument("--dtypes", default="float32,bfloat16",
                      help="model.compute_dtype values of the inner loop, measured in turn")
  parser.add_argument("--attention", choices=model_lib.ATTENTIONS, default="auto",
                      help="model.attention of the inner loop (cudnn: also under XLA's "
                           "deterministic ops)")
  parser.add_argument("--no-outer", action="store_true", help="the inner loop only")
  parser.add_argument("--versus", metavar="FILE",
                      help="benchmarks/torch_gpt_step.py's output on this card: prints ours ÷ "
                           "PyTorch (tokens/s) and both MFUs, for the first of --dtypes")
  parser.add_argument("--peak-tflops", type=float, help="override the device's matmul peak")
  parser.add_argument("--peak-hbm-gbs", type=float, help="override the device's HBM peak")
  return parser.parse_args(argv)


def _resolve(args: argparse.Namespace, platform: str) -> tuple[dict, bool]:
  """The sizes to run with (explicit flags over --small/full defaults), and whether CPU fell back."""
  fallback = platform == "cpu" and not args.small
  base = SMALL if (args.small or fallback) else FULL
  sizes = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
  return sizes, fallback


def bench_inner(sizes: dict, compute_dtype: str = "float32", attention: str = "auto") -> dict:
  """Tokens/s and FLOP/s of ``InnerLoop.run_jit`` on the project's GPT."""
  config = model_lib.ModelConfig(vocab_size=sizes["vocab"], d_model=sizes["d_model"],
                                 num_layers=sizes["layers"], num_heads=sizes["heads"],
                                 context=sizes["context"], compute_dtype=compute_dtype,
                                 attention=attention)
  graphdef, params = model_lib.init(config, seed=0)
  n_total = model_lib.num_params(params)
  n_embed = params["embed"]["embedding"].size + params["pos"].size
  n_non_embed = n_total - n_embed
  tokens_in = jnp.zeros((1, config.context), jnp.int32)
  logits = jax.eval_shape(lambda p, t: model_lib.apply(graphdef, p, t), params, tokens_in)
  param_dtypes = sorted({x.dtype.name for x in jax.tree.leaves(params)})

  loop = inner.InnerLoop(functools.partial(model_lib.loss, graphdef), inner.adamw())
  h, batch, t = sizes["steps"], sizes["batch"], config.context
  rng = np.random.default_rng(0)
  batches = jnp.asarray(rng.integers(0, min(config.vocab_size, 256), (h, batch, t + 1)), jnp.int32)
  key = jax.random.key(0)
  state = loop.start(params)
  del params  # only the loop's donated copy stays alive
  t0 = time.perf_counter()
  state, metrics = loop.run_jit(state, batches, key)  # compile + first call
  jax.block_until_ready((state, metrics))
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(sizes["repeats"]):
    t0 = time.perf_counter()
    state, metrics = loop.run_jit(state, batches, key)
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - t0)
  seconds = statistics.median(times)
  loss = float(metrics.loss[-1])
  del state

  flops_per_token = 6 * n_non_embed + 12 * config.num_layers * config.d_model * t
  tokens_per_s = h * batch * t / seconds
  return dict(d_model=config.d_model, layers=config.num_layers, heads=config.num_heads,
              context=t, vocab=config.vocab_size, params=n_total, non_embedding_params=n_non_embed,
              param_dtypes=param_dtypes, compute_dtype=logits.dtype.name, batch=batch, steps=h,
              attention=model_lib.attention_implementation(
                  logits.dtype, config.d_model // config.num_heads, attention),
              repeats=sizes["repeats"], compile_and_first_call_s=compile_s,
              seconds_per_call=seconds, seconds_per_call_min=min(times),
              seconds_per_call_max=max(times), tokens_per_s=tokens_per_s,
              flops_per_token=flops_per_token, achieved_flops=flops_per_token * tokens_per_s,
              last_loss=loss)


def _outer_tree(sizes: dict) -> dict:
  if sizes["tree"] == "small":
    return tinygpt_shaped_tree(50257)
  config = model_lib.ModelConfig(vocab_size=sizes["vocab"], d_model=sizes["d_model"],
                                 num_layers=sizes["layers"], num_heads=sizes["heads"],
                                 context=sizes["context"])
  return model_lib.init(config, seed=0)[1]


def _nbytes(tree: Any) -> int:
  return int(sum(x.nbytes for x in jax.tree.leaves(tree)))


def bench_outer(sizes: dict, num_workers: int) -> dict:
  """Median seconds per donated heloco / mla update, and the bytes each must move."""
  params = _outer_tree(sizes)
  leaves, treedef = jax.tree.flatten(params)
  shapes = [x.shape for x in leaves]
  def normal(key):  # a float32 N(0, 1) tree shaped like params, made on device
    leaf_keys = jax.random.split(key, len(shapes))
    return jax.tree.unflatten(treedef, [jax.random.normal(k, shape, jnp.float32)
                                        for k, shape in zip(leaf_keys, shapes)])
  keys = jax.random.split(jax.random.key(1), 5)
  drift = normal(keys[0])
  # Distinct pseudo-gradients so heloco takes every branch, not one cached path.
  deltas = [jax.tree.map(lambda d, n, s=s: d * s + n, drift, normal(k))
            for s, k in zip((1.0, -1.0, 0.1, 0.5), keys[1:])]
  del drift
  rules = {"heloco": hj.heloco(num_workers=num_workers), "mla": hj.mla(num_workers=num_workers)}
  # The same numbers in one leaf: what the tree's per-leaf structure costs (heloco's
  # per-tensor rule then sees one tensor; a bound on cost, not the same math).
  flat = lambda tree: {"flat": ravel_pytree(tree)[0]}
  # The server's packed layout (OuterServer(packed=True)): θ and the state in one buffer
  # per dtype, Δ arriving as a tree and packed once per arrival; heloco's per-leaf math kept.
  pack = jax.jit(packing.pack)
  variants = {"": (params, deltas), "flat_": (flat(params), [flat(d) for d in deltas]),
              "packed_": (pack(params), deltas)}
  steps, states, current, counts, deltas_of = {}, {}, {}, {}, {}
  for (prefix, (start, key_deltas)), (name, tx) in itertools.product(variants.items(),
                                                                     rules.items()):
    key = prefix + name
    deltas_of[key] = key_deltas
    step = server.jit_outer_step(tx)
    steps[key] = ((lambda p, s, d, t, step=step: step(p, s, pack(d), t)) if prefix == "packed_"
                  else step)  # a packed server packs each Δ once, then steps
    current[key] = jax.tree.map(jnp.copy, start)
    states[key] = tx.init(current[key])
    param_b, state_b = _nbytes(current[key]), _nbytes(states[key])
    delta_b, momentum_b = _nbytes(key_deltas[0]), _nbytes(states[key].momentum)
    # Read θ, Δ, state; write θ, state (scalar state leaves included: < 1 KB).
    counts[key] = dict(param_bytes=param_b, delta_bytes=delta_b, state_bytes=state_b,
                       state_leaves=len(jax.tree.leaves(states[key])),
                       bytes_lower_bound=2 * param_b + delta_b + 2 * state_b)
    if name == "heloco":  # + the reduction pass over Δ and m before the update pass
      counts[key]["bytes_two_pass"] = counts[key]["bytes_lower_bound"] + delta_b + momentum_b
    for i in range(3):  # compile and warm up; momentum becomes non-zero
      current[key], states[key] = steps[key](current[key], states[key], key_deltas[i % 4],
                                             jnp.int32(i))
    jax.block_until_ready((current[key], states[key]))
  n_leaves, n_params = len(leaves), int(sum(x.size for x in leaves))
  del params, leaves, deltas, variants  # θ lives on in ``current`` (copies)
  chain = sizes["chain"]
  samples = {key: [] for key in steps}
  for r in range(sizes["outer_repeats"]):
    for key, key_deltas in deltas_of.items():  # interleaved: noise hits every variant alike
      t0 = time.perf_counter()
      for c in range(chain):
        i = r * chain + c
        current[key], states[key] = steps[key](current[key], states[key], key_deltas[i % 4],
                                               jnp.int32(i % 7))
      jax.block_until_ready((current[key], states[key]))
      samples[key].append((time.perf_counter() - t0) / chain)
  out = dict(tree=sizes["tree"], params=n_params, leaves=n_leaves, num_workers=num_workers,
             repeats=sizes["outer_repeats"], chain=chain)
  for key in steps:
    seconds = statistics.median(samples[key])
    entry = dict(counts[key], seconds_per_update=seconds,
                 seconds_per_update_min=min(samples[key]),
                 achieved_bytes_per_s=counts[key]["bytes_lower_bound"] / seconds)
    if "bytes_two_pass" in entry:
      entry["achieved_bytes_per_s_two_pass"] = entry["bytes_two_pass"] / seconds
    out[key] = entry
  for prefix in ("", "flat_", "packed_"):
    out[f"{prefix}ratio_heloco_mla"] = (out[f"{prefix}heloco"]["seconds_per_update"]
                                        / out[f"{prefix}mla"]["seconds_per_update"])
  for name in rules:
    for variant in ("flat", "packed"):
      out[f"tree_over_{variant}_{name}"] = (out[name]["seconds_per_update"]
                                            / out[f"{variant}_{name}"]["seconds_per_update"])
  return out


def _fraction(value: float, peak: Optional[float]) -> str:
  return f"{value / peak:6.1%}" if peak else "n/a"


def run(args: argparse.Namespace) -> dict:
  """Runs both measurements, prints them, and returns every number as a dict."""
  device = jax.devices()[0]
  platform = device.platform
  sizes, fallback = _resolve(args, platform)
  table_name, flops_peaks, hbm_peak = device_peaks(device.device_kind)
  print(f"# jax {jax.__version__}; device {device.device_kind!r} (platform {platform}, "
        f"{jax.device_count()} device(s), timed on device 0); peak table entry: "
        f"{table_name or 'none'}")
  if fallback:
    print("# note: platform is cpu and --small was not given; the 125M model is too slow "
          "here, so falling back to --small sizes")

  inners = {}
  for dtype in args.dtypes.split(","):
    inners[dtype] = _report_inner(bench_inner(sizes, dtype, args.attention), args, platform,
                                  flops_peaks, table_name)
  if len(inners) > 1:
    base = inners[args.dtypes.split(",")[0]]["tokens_per_s"]
    print("\ninner loop tokens/s, side by side: " + ", ".join(
        f"{d} {r['tokens_per_s']:.0f} ({r['tokens_per_s'] / base:.2f}x)" for d, r in inners.items()))
  r = next(iter(inners.values()))
  versus = _versus(r, args.versus, flops_peaks) if args.versus else None
  o = None if args.no_outer else _report_outer(bench_outer(sizes, args.num_workers), args,
                                                 hbm_peak)
  return dict(jax_version=jax.__version__, device_kind=device.device_kind, platform=platform,
              device_count=jax.device_count(), peak_table_entry=table_name,
              small=bool(args.small or fallback), small_fallback=fallback, inner=r,
              inner_by_dtype=inners, outer=o, versus=versus,
              xla_flags=os.environ.get("XLA_FLAGS", ""))


def _versus(ours: dict, path: str, flops_peaks: dict) -> dict:
  """Ours beside PyTorch's inner step on the same card (``benchmarks/torch_gpt_step.py``'s
  RESULT in ``path``): tokens/s, their ratio and both MFUs against the bf16 peak."""
  with open(path, encoding="utf-8") as f:
    theirs = json.loads(next(line for line in f if line.startswith("RESULT "))[7:])
  same = all(ours[k] == theirs[k] for k in ("d_model", "layers", "heads", "context", "vocab",
                                           "batch", "steps"))
  peak = flops_peaks.get("bf16")
  mfu = lambda r: r["achieved_flops"] / peak if peak else None
  ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
  print(f"\nours ÷ PyTorch ({theirs['dtype']} autocast, "
        f"{'torch.compile' if theirs['compiled'] else 'eager'}, torch {theirs['torch_version']})"
        f"{'' if same else ' (NOT the same sizes)'}: {ours['tokens_per_s']:.0f} ÷ "
        f"{theirs['tokens_per_s']:.0f} tokens/s = {ratio:.2f}x; MFU vs dense bf16 peak "
        + (f"{mfu(ours):.1%} vs {mfu(theirs):.1%}" if peak else "n/a (unknown peak)"))
  return dict(torch=theirs, same_sizes=same, ours_over_torch=ratio, ours_mfu_bf16=mfu(ours),
              torch_mfu_bf16=mfu(theirs))


def _report_inner(r: dict, args: argparse.Namespace, platform: str, flops_peaks: dict,
                  table_name: Optional[str]) -> dict:
  """Prints one inner-loop measurement with its MFU; returns it completed."""
  peak_key, peak_reason = matmul_peak_key(platform, r["compute_dtype"])
  if args.peak_tflops:
    peak, peak_source = args.peak_tflops * 1e12, "--peak-tflops"
  elif peak_key in flops_peaks:
    peak, peak_source = flops_peaks[peak_key], f"{table_name} dense {peak_key}"
  else:
    peak, peak_source = None, None
  r.update(peak_flops=peak, peak_source=peak_source, matmul_mode=peak_reason,
           mfu=r["achieved_flops"] / peak if peak else None,
           mfu_vs_bf16_peak=(r["achieved_flops"] / flops_peaks["bf16"]
                             if "bf16" in flops_peaks else None))
  print(f"\ninner loop: InnerLoop.run_jit, H = {r['steps']} AdamW steps per call, batch "
        f"{r['batch']}, median of {r['repeats']} calls after a warm-up compile")
  print(f"  model: GPT d_model {r['d_model']}, {r['layers']} layers, {r['heads']} heads, context "
        f"{r['context']}, vocab {r['vocab']}: {r['params'] / 1e6:.2f}M parameters built "
        f"({r['non_embedding_params'] / 1e6:.2f}M non-embedding)")
  print(f"  dtype: params {'/'.join(r['param_dtypes'])}, activations {r['compute_dtype']}; "
        f"matmuls: {peak_reason}; attention: {r['attention']}")
  print(f"  FLOPs/token = 6·N + 12·L·d·T = {r['flops_per_token'] / 1e9:.3f} GFLOP")
  print(f"  compile + first call     {r['compile_and_first_call_s']:9.2f} s")
  print(f"  per call                 {r['seconds_per_call'] * 1e3:9.2f} ms "
        f"(min {r['seconds_per_call_min'] * 1e3:.2f}, max {r['seconds_per_call_max'] * 1e3:.2f})")
  print(f"  tokens/s                 {r['tokens_per_s']:9.0f}")
  print(f"  achieved                 {r['achieved_flops'] / 1e12:9.3f} TFLOP/s")
  if peak:
    print(f"  MFU                      {r['mfu']:9.1%}  (of {peak / 1e12:.1f} TFLOP/s, "
          f"{peak_source})")
  else:
    print("  MFU                      n/a (unknown peak; pass --peak-tflops)")
  if r["mfu_vs_bf16_peak"] is not None and peak_key != "bf16":
    print(f"  MFU vs dense bf16 peak   {r['mfu_vs_bf16_peak']:9.1%}  "
          f"(of {flops_peaks['bf16'] / 1e12:.1f} TFLOP/s)")
  print(f"  last loss                {r['last_loss']:9.3f}")
  return r


def _report_outer(o: dict, args: argparse.Namespace, hbm_peak: Optional[float]) -> dict:
  """Prints the outer-step measurement against the HBM peak; returns it completed."""
  hbm = args.peak_hbm_gbs * 1e9 if args.peak_hbm_gbs else hbm_peak
  o["peak_hbm_bytes_per_s"] = hbm
  tree_name = ("outer_step.py's TinyGPT-shaped tree, vocab 50257" if o["tree"] == "small"
               else "the inner loop's GPT params")
  print(f"\nouter step: jitted update + apply, params and state donated, K = {o['num_workers']}; "
        f"median of {o['repeats']} interleaved samples of {o['chain']} update(s)")
  print(f"  tree: {tree_name}, {o['params'] / 1e6:.2f}M parameters, {o['leaves']} leaves")
  print("  bytes/update (lower bound) = read θ, Δ, state + write θ, state")
  for name in ("heloco", "mla"):
    e = o[name]
    e["hbm_fraction"] = e["achieved_bytes_per_s"] / hbm if hbm else None
    print(f"  {name:7s} {e['seconds_per_update'] * 1e3:9.3f} ms/update  "
          f"{e['bytes_lower_bound'] / 1e6:9.1f} MB  {e['achieved_bytes_per_s'] / 1e9:8.1f} GB/s  "
          f"{_fraction(e['achieved_bytes_per_s'], hbm)} of peak HBM  "
          f"(state {e['state_leaves']} leaves, {e['state_bytes'] / 1e6:.1f} MB)")
  e = o["heloco"]
  e["hbm_fraction_two_pass"] = e["achieved_bytes_per_s_two_pass"] / hbm if hbm else None
  print(f"  heloco with its reduction pass (+ read Δ, m): {e['bytes_two_pass'] / 1e6:.1f} MB, "
        f"{e['achieved_bytes_per_s_two_pass'] / 1e9:.1f} GB/s, "
        f"{_fraction(e['achieved_bytes_per_s_two_pass'], hbm)} of peak HBM")
  print(f"  peak HBM: {f'{hbm / 1e12:.2f} TB/s' if hbm else 'unknown (pass --peak-hbm-gbs)'}")
  print(f"  ratio heloco/mla time   {o['ratio_heloco_mla']:.3f}")
  print("  the same numbers in one flat leaf (what the per-leaf structure costs):")
  for name in ("heloco", "mla"):
    e = o[f"flat_{name}"]
    print(f"  {name:7s} {e['seconds_per_update'] * 1e3:9.3f} ms/update  "
          f"{e['achieved_bytes_per_s'] / 1e9:8.1f} GB/s  "
          f"{_fraction(e['achieved_bytes_per_s'], hbm)} of peak HBM  "
          f"tree ÷ flat {o[f'tree_over_flat_{name}']:.2f}x")
  print(f"  ratio heloco/mla time, flat   {o['flat_ratio_heloco_mla']:.3f}")
  print("  the server's packed layout (one buffer per dtype, per-leaf math kept; Δ packed, then "
        "the step):")
  for name in ("heloco", "mla"):
    e = o[f"packed_{name}"]
    e["hbm_fraction"] = e["achieved_bytes_per_s"] / hbm if hbm else None
    print(f"  {name:7s} {e['seconds_per_update'] * 1e3:9.3f} ms/update  "
          f"{e['achieved_bytes_per_s'] / 1e9:8.1f} GB/s  "
          f"{_fraction(e['achieved_bytes_per_s'], hbm)} of peak HBM  "
          f"tree ÷ packed {o[f'tree_over_packed_{name}']:.2f}x")
  print(f"  ratio heloco/mla time, packed {o['packed_ratio_heloco_mla']:.3f}  (target <= 1.4)")
  return o


def main(argv: Optional[Sequence[str]] = None) -> dict:
  result = run(parse_args(argv))
  print("RESULT " + json.dumps(result, sort_keys=True))
  return result


if __name__ == "__main__":
  main()
