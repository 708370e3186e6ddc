"""PyTorch bf16 + ``torch.compile``: the inner step of the GPT that device_step.py times.

The denominator of "ours ÷ PyTorch on the same card" (issue 59, item 3): the same GPT as
``benchmarks/torch_reference.py`` (the project's TinyGPT in PyTorch: pre-LN blocks, fused
bias-free QKV, ``scaled_dot_product_attention``, tanh-GELU MLP, untied head), at the sizes of
``benchmarks/device_step.py`` (GPT-2 small: d_model 768, 12 layers, 12 heads, context 1024;
``--vocab 50257`` is GPT-2-124M's shape), trained the way a PyTorch user runs it fast:
parameters float32, matmuls and activations bfloat16 under ``torch.autocast`` (as the
project's ``model.compute_dtype=bfloat16``), the model through ``torch.compile``, fused
AdamW (β = 0.9, 0.95, weight decay 0.1 on matrices) after global-norm clipping at 1.0.
H steps per timed call, as ``InnerLoop.run_jit``; the median of ``--repeats`` calls after
a warm-up call that compiles. FLOPs per token as device_step.py (PaLM, appendix B):
6·N + 12·L·d_model·T, N the non-embedding parameters.

Imports neither jax nor heloco_jax (it runs where only torch is installed). Prints the
numbers, then ``RESULT {json}``; ``benchmarks/gpu.sh`` puts it beside device_step.py's and
prints ours ÷ PyTorch and both MFUs.

  python benchmarks/torch_gpt_step.py [--vocab 257] [--small] [--no-compile]
      [--dtype bfloat16|float32] [--batch 8] [--steps 10] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

try:  # python -m benchmarks.torch_gpt_step
  from benchmarks.torch_reference import GPT, loss_fn
except ImportError:  # python benchmarks/torch_gpt_step.py
  from torch_reference import GPT, loss_fn

# device_step.py's FULL and SMALL sizes.
FULL = dict(d_model=768, layers=12, heads=12, context=1024, batch=8, steps=10, repeats=5)
SMALL = dict(d_model=128, layers=2, heads=4, context=128, batch=2, steps=2, repeats=3)


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--small", action="store_true",
                      help="device_step.py's smoke sizes; automatic without CUDA")
  parser.add_argument("--vocab", type=int, default=257, help="257 (bytes + BOS) or 50257")
  parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                      help="autocast dtype of matmuls and activations")
  parser.add_argument("--no-compile", action="store_true", help="eager (no torch.compile)")
  for name in ("d-model", "layers", "heads", "context", "batch", "steps", "repeats"):
    parser.add_argument(f"--{name}", type=int)
  return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
  cuda = torch.cuda.is_available()
  device = torch.device("cuda" if cuda else "cpu")
  base = SMALL if (args.small or not cuda) else FULL
  sizes = {k: getattr(args, k) if getattr(args, k, None) is not None else v
           for k, v in base.items()}
  torch.manual_seed(0)
  if cuda:
    torch.backends.cuda.matmul.allow_tf32 = True  # float32 matmuls: TF32, as XLA's default
    torch.backends.cudnn.allow_tf32 = True
  model = GPT(sizes["d_model"], sizes["layers"], sizes["heads"], sizes["context"],
              vocab_size=args.vocab).to(device)
  n_total = sum(p.numel() for p in model.parameters())
  n_non_embed = n_total - model.embed.weight.numel() - model.pos.numel()
  matrices = [p for p in model.parameters() if p.ndim >= 2]
  vectors = [p for p in model.parameters() if p.ndim < 2]
  optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                                 {"params": vectors, "weight_decay": 0.0}],
                                lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=cuda)
  forward = model if args.no_compile else torch.compile(model)
  dtype = getattr(torch, args.dtype)
  h, batch, t = sizes["steps"], sizes["batch"], sizes["context"]
  generator = torch.Generator().manual_seed(0)
  batches = torch.randint(0, min(args.vocab, 256), (h, batch, t + 1),
                          generator=generator).to(device)

  def call() -> float:
    """H steps; returns the last step's loss (read after the timing ends)."""
    for i in range(h):
      with torch.autocast(device.type, dtype=dtype, enabled=args.dtype != "float32"):
        loss = loss_fn(forward, batches[i])
      loss.backward()
      torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
      optimizer.step()
      optimizer.zero_grad(set_to_none=True)
    return loss

  def synchronize():
    if cuda:
      torch.cuda.synchronize()

  t0 = time.perf_counter()
  call()  # compiles
  synchronize()
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(sizes["repeats"]):
    t0 = time.perf_counter()
    loss = call()
    synchronize()
    times.append(time.perf_counter() - t0)
  seconds = statistics.median(times)
  flops_per_token = 6 * n_non_embed + 12 * sizes["layers"] * sizes["d_model"] * t
  tokens_per_s = h * batch * t / seconds
  return dict(torch_version=torch.__version__, device=torch.cuda.get_device_name(0) if cuda
              else "cpu", compiled=not args.no_compile, dtype=args.dtype, vocab=args.vocab,
              **sizes, params=n_total, non_embedding_params=n_non_embed,
              compile_and_first_call_s=compile_s, seconds_per_call=seconds,
              tokens_per_s=tokens_per_s, flops_per_token=flops_per_token,
              achieved_flops=flops_per_token * tokens_per_s, last_loss=float(loss.detach()))


def main(argv=None) -> dict:
  r = run(parse_args(argv))
  print(f"# torch {r['torch_version']} on {r['device']}: GPT d_model {r['d_model']}, "
        f"{r['layers']} layers, {r['heads']} heads, context {r['context']}, vocab {r['vocab']} "
        f"({r['params'] / 1e6:.1f}M parameters), batch {r['batch']}, H = {r['steps']}, "
        f"{r['dtype']} autocast, {'torch.compile' if r['compiled'] else 'eager'}")
  print(f"  compile + first call {r['compile_and_first_call_s']:9.2f} s")
  print(f"  per call             {r['seconds_per_call'] * 1e3:9.2f} ms")
  print(f"  tokens/s             {r['tokens_per_s']:9.0f}")
  print(f"  achieved             {r['achieved_flops'] / 1e12:9.3f} TFLOP/s")
  print(f"  last loss            {r['last_loss']:9.3f}")
  print("RESULT " + json.dumps(r, sort_keys=True))
  return r


if __name__ == "__main__":
  main()
