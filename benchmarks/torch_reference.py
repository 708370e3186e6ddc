"""PyTorch (CPU, eager) reference: the quickstart's async HeLoCo run, harness style.

A plain PyTorch simulation of the same asynchronous HeLoCo run as heloco_jax's
quickstart (``heloco_jax/cli/configs/default.py``), written the way the HeLoCo
authors' reference harness is: one Python iteration per inner step, one
worker's H steps at a time, ``torch.optim.AdamW`` + ``clip_grad_norm_`` with
a hand-set learning rate, and a per-tensor Python loop for the outer rule.
Its steady-state tokens/s is the denominator of "heloco_jax tokens/s ÷
PyTorch tokens/s" (issue 8); it imports neither jax nor heloco_jax, so it
runs in an environment of its own:

  python3 -m venv /tmp/torch_env
  /tmp/torch_env/bin/pip install -r benchmarks/torch_requirements.txt
  /tmp/torch_env/bin/python benchmarks/torch_reference.py [--tokens 200000] [--threads N]

The last line printed is ``RESULT {json}``.

Matched (same values as the quickstart):
  * Model: TinyGPT of ``heloco_jax/lm/model.py`` at d_model 128, 4 layers, 4 heads,
    context 128: 257-token byte vocabulary (256 bytes + BOS), token and learned
    position embeddings, pre-LayerNorm blocks (LayerNorm ε = 1e-6, as flax),
    fused bias-free QKV, causal attention (``scaled_dot_product_attention``),
    tanh-GELU MLP of width 4·d_model (``jax.nn.gelu``'s default), final
    LayerNorm, untied head; N(0, 0.02²) init, residual outputs / √(2·layers).
    float32 throughout; 874,241 parameters, 50 tensors, as heloco_jax.
  * Inner optimizer (``heloco_jax/training/inner.py``): AdamW (β = 0.9, 0.95, ε = 1e-8,
    weight decay 0.1 on matrices only), global-norm clipping at 1.0, linear
    warm-up from 0 over 20 steps then cosine to 0.1·3e-3 at step 2000, indexed
    by the worker's own step count; AdamW moments reset at every dispatch
    (a fresh ``torch.optim.AdamW``), the step count kept.
  * Outer rule (ALGORITHMS.md, "HeLoCo"): ρ = 1/√K (constant), ρ applied
    before the correction; per-tensor cosine against the momentum before the
    arrival with the pass / keep / shrink / rotate branches ("normalized"
    rotation schedule); m ← μ·m + (1 − μ)·G; θ ← θ − η·(G + μ·m); workers
    dispatched from the look-ahead point θ − η·μ·m. η = 0.7, μ = 0.9,
    c_ok = 0.2, c_bad = −0.2, k_s = 0.5, β_max = 0.5, k_d = 1.0, κ = 3.0, ε = 1e-8.
  * Scheduler (``heloco_jax/runtime/loops.py``, simulated runtime): K = 5 workers,
    H = 20, batch 8, "severe" speeds (1, 15, 15, 15, 15 seconds per step);
    a heap of (finish time, worker); a worker's H steps are computed when it
    is dispatched and delivered at finish = now + message + H·t_i + message
    (communication free, message = 0); one outer update per arrival, then
    that worker is re-dispatched; the token budget counts the tokens of
    arrivals, and the arrival that would pass it ends the run (work in flight
    is discarded).
  * Timing: as ``benchmarks/simulator_overhead.py`` times the JAX simulation,
    from the first timed arrival to the last, tokens of the arrivals in
    between; ``--warmup-dispatches`` (default K) keeps the first dispatches
    (torch's one-time costs) out of the window, so with the default the window
    starts at the first arrival, exactly as on the JAX side.

Not matched:
  * Data: not heloco_jax's synthetic corpus or grain pipeline. Worker i reads
    its own synthetic "language", a random sparse byte-bigram chain (each
    byte has 8 possible successors with Dirichlet(1) probabilities), generated
    once before timing; a step only slices B random windows of T + 1 tokens,
    so data costs about what indexing the JAX side's pre-tokenised arrays
    costs. Its entropy rate (printed) is well below ln 256, so the falling
    training loss shows that the run learns.
  * No evaluation, checkpoints, metrics rows, NaN/Inf rejection of
    pseudo-gradients, grace window, jitter or DyLU.
  * No ``torch.compile``: eager, as the authors' harness.

Threads: ``--threads`` defaults to ``os.cpu_count()``. torch's OpenMP pool is
very sensitive to other processes on the same cores (on a shared 2-core
machine one step took 80 ms with 1 thread and 100 ms to 2.8 s with 2), so
compare with the JAX figure measured back to back, and check the load
average recorded in RESULT.
"""

from __future__ import annotations

import argparse
import copy
import heapq
import json
import math
import os
import platform
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

VOCAB_SIZE = 257  # 256 bytes + BOS, as heloco_jax.lm.model.BYTE_VOCAB_SIZE
INIT_STD = 0.02
LAYER_NORM_EPS = 1e-6  # flax nnx.LayerNorm's default

# Seconds per inner step for 5 workers (heloco_jax/runtime/clocks.py, the HeLoCo authors' presets).
PRESETS = {
    "homogeneous": (1.0, 1.0, 1.0, 1.0, 1.0),
    "mild": (1.0, 1.0, 1.0, 2.0, 2.0),
    "moderate": (1.0, 6.0, 6.0, 6.0, 6.0),
    "severe": (1.0, 15.0, 15.0, 15.0, 15.0),
    "mixed": (1.0, 2.0, 3.0, 1.0, 5.0),
}

BRANCHES = ("pass", "keep", "shrink", "rotate")


# ------------------------------------------------------------------- model

class CausalSelfAttention(nn.Module):
  def __init__(self, d_model: int, num_heads: int, out_std: float):
    super().__init__()
    self.num_heads = num_heads
    self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)  # bias-free, as heloco_jax
    self.out = nn.Linear(d_model, d_model)
    nn.init.normal_(self.qkv.weight, std=INIT_STD)
    nn.init.normal_(self.out.weight, std=out_std)
    nn.init.zeros_(self.out.bias)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    batch, length, d_model = x.shape
    head_dim = d_model // self.num_heads
    # (B, T, 3·heads, hd) split into q, k, v along the head axis, as heloco_jax.
    qkv = self.qkv(x).view(batch, length, 3, self.num_heads, head_dim).permute(2, 0, 3, 1, 4)
    y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
    return self.out(y.transpose(1, 2).reshape(batch, length, d_model))


class Block(nn.Module):
  """Pre-LN block: x + attn(ln(x)); x + mlp(ln(x))."""

  def __init__(self, d_model: int, num_heads: int, num_layers: int, mlp_ratio: int = 4):
    super().__init__()
    out_std = INIT_STD / (2 * num_layers) ** 0.5
    self.ln1 = nn.LayerNorm(d_model, eps=LAYER_NORM_EPS)
    self.attn = CausalSelfAttention(d_model, num_heads, out_std)
    self.ln2 = nn.LayerNorm(d_model, eps=LAYER_NORM_EPS)
    self.up = nn.Linear(d_model, mlp_ratio * d_model)
    self.down = nn.Linear(mlp_ratio * d_model, d_model)
    nn.init.normal_(self.up.weight, std=INIT_STD)
    nn.init.normal_(self.down.weight, std=out_std)
    nn.init.zeros_(self.up.bias)
    nn.init.zeros_(self.down.bias)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    x = x + self.attn(self.ln1(x))
    return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
  """Token + learned position embeddings, pre-LN blocks, final LN, untied head."""

  def __init__(self, d_model: int, num_layers: int, num_heads: int, context: int,
               vocab_size: int = VOCAB_SIZE):
    super().__init__()
    self.embed = nn.Embedding(vocab_size, d_model)
    self.pos = nn.Parameter(INIT_STD * torch.randn(context, d_model))
    self.blocks = nn.ModuleList([Block(d_model, num_heads, num_layers)
                                 for _ in range(num_layers)])
    self.ln_f = nn.LayerNorm(d_model, eps=LAYER_NORM_EPS)
    self.head = nn.Linear(d_model, vocab_size)
    nn.init.normal_(self.embed.weight, std=INIT_STD)
    nn.init.normal_(self.head.weight, std=INIT_STD)
    nn.init.zeros_(self.head.bias)

  def forward(self, tokens: torch.Tensor) -> torch.Tensor:
    x = self.embed(tokens) + self.pos[: tokens.shape[-1]]
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln_f(x))


def loss_fn(model: GPT, sequences: torch.Tensor) -> torch.Tensor:
  """Mean next-token cross entropy: inputs [:, :-1], targets [:, 1:]."""
  logits = model(sequences[:, :-1])
  return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), sequences[:, 1:].reshape(-1))


# -------------------------------------------------------------------- data

class BigramLanguage:
  """One worker's synthetic language: a sparse random byte-bigram chain.

  ``streams`` (chains, length) uint8 is generated once; a batch is B random
  windows of T + 1 tokens of it (an index, like the JAX side's pre-tokenised
  arrays).
  """

  def __init__(self, seed: int, worker: int, context: int, successors: int = 8,
               chains: int = 64, length: int = 4096):
    rng = np.random.default_rng([seed, worker, 8])
    self.next_tokens = np.stack([rng.choice(256, successors, replace=False) for _ in range(256)])
    probs = rng.dirichlet(np.ones(successors), size=256)
    cdf = np.cumsum(probs, axis=1)
    streams = np.empty((chains, length), np.uint8)
    streams[:, 0] = rng.integers(0, 256, chains)
    for t in range(1, length):
      prev = streams[:, t - 1]
      choice = (cdf[prev] < rng.random((chains, 1))).sum(axis=1).clip(max=successors - 1)
      streams[:, t] = self.next_tokens[prev, choice]
    self.streams = streams
    self.window = context + 1
    self.rng = rng
    # Entropy rate under the empirical token frequencies: the loss floor.
    freq = np.bincount(streams[:, :-1].ravel(), minlength=256) / streams[:, :-1].size
    self.entropy = float(-(freq[:, None] * probs * np.log(probs)).sum())

  def batch(self, batch_size: int) -> torch.Tensor:
    chains, length = self.streams.shape
    rows = self.rng.integers(0, chains, batch_size)
    starts = self.rng.integers(0, length - self.window + 1, batch_size)
    windows = self.streams[rows[:, None], starts[:, None] + np.arange(self.window)]
    return torch.from_numpy(windows).long()


# --------------------------------------------------------------- inner loop

def learning_rate(step: int, peak: float, warmup: int, total: int, min_ratio: float) -> float:
  """optax.warmup_cosine_decay_schedule(0, peak, warmup, total, min_ratio·peak) at ``step``."""
  if step < warmup:
    return peak * step / warmup
  end = peak * min_ratio
  progress = min(step - warmup, total - warmup) / (total - warmup)
  return end + (peak - end) * 0.5 * (1.0 + math.cos(math.pi * progress))


class Worker:
  """A worker: its own model copy, language and step count (the LR schedule's index)."""

  def __init__(self, model: GPT, language: BigramLanguage):
    self.model = model
    self.language = language
    self.step = 0

  def run(self, start: list[torch.Tensor], args) -> tuple[list[torch.Tensor], list[float]]:
    """H inner AdamW steps from ``start``; returns (Δ = start − end, the step losses)."""
    params = list(self.model.parameters())
    with torch.no_grad():
      for p, s in zip(params, start):
        p.copy_(s)
    # A fresh AdamW per dispatch: moments reset (inner.reset_optimizer); decay on matrices only.
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for _ in range(args.inner_steps):
      lr = learning_rate(self.step, args.lr, args.warmup_steps, args.total_steps,
                         args.min_lr_ratio)
      for group in optimizer.param_groups:
        group["lr"] = lr
      batch = self.language.batch(args.batch_size)
      loss = loss_fn(self.model, batch)
      optimizer.zero_grad(set_to_none=True)
      loss.backward()
      torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
      optimizer.step()
      self.step += 1
      losses.append(loss.item())
    with torch.no_grad():
      delta = [s - p for s, p in zip(start, params)]
    return delta, losses


# ---------------------------------------------------------------- outer rule

class HeLoCoServer:
  """θ, the outer momentum m and the HeLoCo rule (ALGORITHMS.md, "HeLoCo"), per tensor."""

  def __init__(self, params: list[torch.Tensor], num_workers: int, eta: float = 0.7,
               mu: float = 0.9, c_ok: float = 0.2, c_bad: float = -0.2, k_s: float = 0.5,
               beta_max: float = 0.5, k_d: float = 1.0, kappa: float = 3.0, eps: float = 1e-8):
    self.params = [p.detach().clone() for p in params]
    self.momentum = [torch.zeros_like(p) for p in self.params]
    self.rho = 1.0 / math.sqrt(num_workers)  # weighting "constant"
    self.eta, self.mu = eta, mu
    self.c_ok, self.c_bad, self.k_s, self.beta_max = c_ok, c_bad, k_s, beta_max
    self.k_d, self.kappa, self.eps = k_d, kappa, eps
    self.version = 0
    self.branch_counts = dict.fromkeys(BRANCHES, 0)

  @torch.no_grad()
  def dispatch_point(self) -> list[torch.Tensor]:
    """The look-ahead point θ − η·μ·m (always on for HeLoCo)."""
    step = self.eta * self.mu
    return [p - step * m for p, m in zip(self.params, self.momentum)]

  @torch.no_grad()
  def update(self, delta: list[torch.Tensor]) -> None:
    """One arrival: G = correct(ρ·Δ, m) per tensor (ρ before, the authors' order), then MLA."""
    eps = self.eps
    for p, m, dl in zip(self.params, self.momentum, delta):
      d = self.rho * dl
      d_norm, m_norm = d.norm().item(), m.norm().item()  # m: before this arrival
      if d_norm < eps or m_norm < eps:  # no reference yet: pass (covers step 0)
        g, branch = d, "pass"
      else:
        c = max(-1.0, min(1.0, torch.dot(d.flatten(), m.flatten()).item() / (d_norm * m_norm)))
        conf = d_norm / (d_norm + self.kappa * m_norm + eps)
        if c >= self.c_ok:  # keep
          g, branch = d, "keep"
        elif c < 0:  # shrink: remove a fraction β of the component opposing m
          beta = min(self.k_s * -c * conf, self.beta_max)
          g, branch = d - (beta * c * d_norm / m_norm) * m, "shrink"
        else:  # rotate toward m, norm kept; r(c) "normalized"
          r = min(max((self.c_ok - c) / (self.c_ok - self.c_bad), 0.0), 1.0)
          lam = min(self.k_d * r * conf, 1.0)
          u = ((1.0 - lam) / d_norm) * d + (lam / m_norm) * m
          g, branch = (d_norm / max(u.norm().item(), eps)) * u, "rotate"
      self.branch_counts[branch] += 1
      m.mul_(self.mu).add_(g, alpha=1.0 - self.mu)      # m ← μ·m + (1 − μ)·G
      p.sub_(self.eta * (g + self.mu * m))               # θ ← θ − η·(G + μ·m)
    self.version += 1


# ----------------------------------------------------------------- scheduler

def simulate(args) -> dict:
  wall_start = time.perf_counter()
  k = args.num_workers
  seconds = [PRESETS[args.speeds][i % 5] for i in range(k)]
  torch.manual_seed(args.seed)
  model = GPT(args.d_model, args.num_layers, args.num_heads, args.context)
  num_params = sum(p.numel() for p in model.parameters())
  server = HeLoCoServer(list(model.parameters()), k)
  workers = [Worker(copy.deepcopy(model), BigramLanguage(args.seed, i, args.context))
             for i in range(k)]
  entropy = float(np.mean([w.language.entropy for w in workers]))
  tokens_per_dispatch = args.inner_steps * args.batch_size * args.context
  message = 0.0  # communication free (the quickstart's comm defaults)

  heap: list[tuple[float, int]] = []
  jobs: dict[int, tuple[list[torch.Tensor], int, list[float]]] = {}
  dispatch_seconds: list[float] = []
  first_loss = [math.nan]

  def dispatch(worker: int, now: float) -> None:
    # Lazy timing, as heloco_jax's simulated runtime: compute now, deliver at the finish time.
    start_time = time.perf_counter()
    delta, losses = workers[worker].run(server.dispatch_point(), args)
    dispatch_seconds.append(time.perf_counter() - start_time)
    if math.isnan(first_loss[0]):
      first_loss[0] = losses[0]
    jobs[worker] = (delta, server.version, losses)
    finish = now + message + args.inner_steps * seconds[worker] + message
    heapq.heappush(heap, (finish, worker))

  for worker in range(k):
    dispatch(worker, 0.0)

  tokens, sim_time = 0, 0.0
  staleness: list[int] = []
  arrival_losses: list[float] = []
  outer_seconds: list[float] = []
  marks: list[tuple[float, int]] = []  # (wall time after the update, tokens), per arrival
  while heap:
    now, worker = heapq.heappop(heap)
    delta, version, losses = jobs.pop(worker)
    if tokens + tokens_per_dispatch > args.tokens:
      break  # this arrival and everything in flight are discarded
    tokens, sim_time = tokens + tokens_per_dispatch, now
    staleness.append(server.version - version)
    start_time = time.perf_counter()
    server.update(delta)
    outer_seconds.append(time.perf_counter() - start_time)
    arrival_losses.append(float(np.mean(losses)))
    marks.append((time.perf_counter(), tokens))
    dispatch(worker, now)

  # The timed window: from the arrival after which dispatch number warmup + 1 starts.
  first = max(0, args.warmup_dispatches - k)
  timed = marks[first:]
  if len(timed) >= 2:
    (t0, tokens0), (t1, tokens1) = timed[0], timed[-1]
    tokens_per_second = (tokens1 - tokens0) / (t1 - t0)
    timed_seconds, timed_tokens = t1 - t0, tokens1 - tokens0
  else:
    tokens_per_second = timed_seconds = timed_tokens = None
  last = arrival_losses[-k:]
  return {
      "tokens_per_second": tokens_per_second,
      "timed_tokens": timed_tokens,
      "timed_seconds": timed_seconds,
      "timed_dispatches": max(0, len(timed) - 1),
      "outer_step_ms": 1e3 * float(np.mean(outer_seconds[first:] or outer_seconds or [math.nan])),
      "dispatch_seconds": float(np.mean(dispatch_seconds[k + first:] or dispatch_seconds)),
      "wall_seconds": time.perf_counter() - wall_start,
      "tokens": tokens,
      "sim_time": sim_time,
      "outer_updates": server.version,
      "dispatches": len(dispatch_seconds),
      "mean_staleness": float(np.mean(staleness)) if staleness else 0.0,
      "loss_initial": first_loss[0],
      "loss_final": float(np.mean(last)) if last else None,
      "data_entropy": entropy,
      "branch_counts": server.branch_counts,
      "num_params": num_params,
      "torch": torch.__version__,
      "threads": torch.get_num_threads(),
      "python": platform.python_version(),
      "load_average": os.getloadavg()[0],  # 1-minute, at the end: other processes' CPU use
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=200_000,
                      help="token budget of applied arrivals (default 200000)")
  parser.add_argument("--dispatches", type=int, default=0,
                      help="if > 0, sets --tokens to (N + 1)·H·B·T: N timed dispatches with the "
                           "default warm-up, as simulator_overhead.py --dispatches N")
  parser.add_argument("--num-workers", type=int, default=5)
  parser.add_argument("--inner-steps", type=int, default=20)
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--speeds", default="severe", choices=sorted(PRESETS))
  parser.add_argument("--d-model", type=int, default=128)
  parser.add_argument("--num-layers", type=int, default=4)
  parser.add_argument("--num-heads", type=int, default=4)
  parser.add_argument("--context", type=int, default=128)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--warmup-steps", type=int, default=20)
  parser.add_argument("--total-steps", type=int, default=2_000)
  parser.add_argument("--min-lr-ratio", type=float, default=0.1)
  parser.add_argument("--weight-decay", type=float, default=0.1)
  parser.add_argument("--grad-clip", type=float, default=1.0)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--threads", type=int, default=0,
                      help="torch.set_num_threads; 0 = os.cpu_count()")
  parser.add_argument("--warmup-dispatches", type=int, default=-1,
                      help="dispatches kept out of the timing; -1 = num_workers")
  args = parser.parse_args()
  if args.warmup_dispatches < 0:
    args.warmup_dispatches = args.num_workers
  if args.dispatches > 0:
    args.tokens = (args.dispatches + 1) * args.inner_steps * args.batch_size * args.context
  torch.set_num_threads(args.threads or os.cpu_count())

  result = simulate(args)
  print(f"# torch {result['torch']} (CPU, eager, float32), {result['threads']} threads; "
        f"GPT {result['num_params'] / 1e6:.3f}M params, K = {args.num_workers}, "
        f"H = {args.inner_steps}, batch {args.batch_size}, {args.speeds} speeds")
  print(f"arrivals applied        {result['outer_updates']} ({result['tokens']} tokens, "
        f"{result['dispatches']} dispatches computed, sim time {result['sim_time']:.0f} s, "
        f"mean staleness {result['mean_staleness']:.2f})")
  if result["tokens_per_second"] is None:
    print("steady state            too few arrivals to time; raise --tokens")
  else:
    print(f"steady state            {result['tokens_per_second']:9.0f} tokens/s "
          f"({result['timed_dispatches']} dispatches in {result['timed_seconds']:.1f} s)")
  print(f"outer step              {result['outer_step_ms']:9.2f} ms per update")
  print(f"one dispatch (H steps)  {result['dispatch_seconds']:9.3f} s")
  print(f"training loss           {result['loss_initial']:.3f} -> {result['loss_final']:.3f} "
        f"(ln 256 = {math.log(256):.3f}; data entropy rate {result['data_entropy']:.3f})")
  print(f"branches                {result['branch_counts']}")
  print(f"total wall time         {result['wall_seconds']:9.1f} s")
  print("RESULT " + json.dumps(result))


if __name__ == "__main__":
  main()
