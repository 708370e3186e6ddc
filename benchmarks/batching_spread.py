"""vmap vs sequential worker batching against the seed-to-seed spread (issue 79, item 2).

The model is flax's MNIST tutorial CNN with BatchNorm after each convolution and Dropout
(``benchmarks.users_model.TutorialCNN``, its loss ``engine_loss`` and AdamW ``tx``), batch
32, on K = 5 workers with non-IID synthetic data made here (``users_model.batches`` draws
pure noise with labels that nothing predicts, so its accuracy stays at 10%): 10 classes,
each a fixed smooth 28×28 pattern under Gaussian noise, and worker w sees its own two classes
(2w and 2w + 1, mod 10) 90% of the time and any of the 10 the rest. Each method (diloco, H =
50 as in the issue, AdamW 1e-3 inside; palsgd, H = 50, its own inner step) runs for every
seed with ``hj.simulated_runtime(worker_batching="vmap")`` and ``"sequential"``; the seed
changes the initial weights (``TutorialCNN(nnx.Rngs(seed))``), every worker's data order
and the dropout masks (``hj.simulate(seed=...)``). At the end the held-out loss and accuracy
are measured on 1,000 balanced held-out images with the BatchNorm running statistics
(``model.eval()``). Per method it prints, for each batching, the mean ± sd across seeds,
the paired difference vmap − sequential per seed with its mean and sd, and the verdict:
|mean paired difference| <= the seed-to-seed sd (both batchings' sds pooled), and the
paired sd ÷ the seed sd (≈ √2 = 1.41 when the batching acts like another seed; ≪ 1 when the
two paths stay together).

  taskset -c 0 python -m benchmarks.batching_spread [--seeds 5] [--steps 600]
      [--methods diloco,palsgd] [--workers 5]

``--steps`` counts each worker's steps (the tutorial's "1,200 steps of batch 32" per
worker; the budget is steps × K worker-steps). The default, 600 steps per worker (3,000
worker-steps, 12 rounds of H = 50), is where issue 79 saw the two batchings start to part,
and what the hour of one core set for the 20 runs allows: on this project's 2-core CPU
(2026-12-02) one run takes about 70 s of CPU with "sequential" and 210 s with "vmap" for
diloco, 90 s and 220 s for palsgd, so the defaults take 49 minutes of CPU (2,924 s); the
issue's 1,200 steps would take about 100. The patterns' contrast (SIGNAL, with shifts of up to
4 pixels) was set so one diloco run ends near the issue's 90% held-out accuracy (91.6%).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import heloco_jax as hj
from benchmarks import users_model

BATCH = 32
H = 50
CLASSES = 10
MAIN = 0.9  # the share of a worker's batches drawn from its own two classes
SIGNAL = 0.35  # the patterns' scale against noise of sd 1
SHIFT = 4  # pixels
# 10 smooth patterns: 7×7 Gaussian values, each spread over a 4×4 block of pixels
PATTERNS = np.kron(np.random.default_rng(1234).normal(0, 1, (CLASSES, 7, 7)),
                   np.ones((4, 4)))[..., None].astype(np.float32)


def images(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """Each label's pattern shifted by up to ±SHIFT pixels each way, at a random contrast
  (0.5 to 1.5), under noise of sd 1."""
  shifts = rng.integers(-SHIFT, SHIFT + 1, (len(labels), 2))
  contrast = rng.uniform(0.5, 1.5, len(labels))
  drawn = np.stack([np.roll(PATTERNS[y], tuple(shift), axis=(0, 1))
                    for y, shift in zip(labels, shifts)])
  return (SIGNAL * contrast[:, None, None, None] * drawn
          + rng.normal(0, 1, (len(labels), 28, 28, 1))).astype(np.float32)


def batches(worker: int, seed: int):
  """Endless non-IID batches of ``worker``: its two classes 90% of the time."""
  rng = np.random.default_rng([seed, worker])
  own = np.array([(2 * worker) % CLASSES, (2 * worker + 1) % CLASSES])
  while True:
    labels = np.where(rng.random(BATCH) < MAIN, rng.choice(own, BATCH),
                      rng.integers(0, CLASSES, BATCH))
    yield images(labels, rng), labels.astype(np.int32)


_rng = np.random.default_rng(999)
HELD_OUT_Y = np.arange(1000) % CLASSES
HELD_OUT_X = images(HELD_OUT_Y, _rng)


def problem(seed: int):
  """(loss_fn, params, BatchNorm statistics, eval_fn) with the weights of ``seed``."""
  loss_fn, _, _ = users_model.engine_loss(users_model.TutorialCNN)
  graphdef, params, stats, rest = nnx.split(users_model.TutorialCNN(nnx.Rngs(seed)),
                                            nnx.Param, nnx.BatchStat, ...)

  @jax.jit
  def eval_fn(params, *, state):
    model = nnx.merge(graphdef, params, state, rest, copy=True)
    model.eval()  # the BatchNorm running statistics, no dropout
    logits = model(HELD_OUT_X)
    return {"val_loss": optax.softmax_cross_entropy_with_integer_labels(
                logits, HELD_OUT_Y).mean(),
            "accuracy": jnp.mean(logits.argmax(-1) == HELD_OUT_Y)}
  return loss_fn, params, stats, eval_fn


def run(method: str, seed: int, batching: str, steps: int, k: int) -> dict:
  cpu, wall = time.process_time(), time.perf_counter()
  loss_fn, params, stats, eval_fn = problem(seed)
  options = {} if method == "palsgd" else {"inner_tx": users_model.tx()}  # PALSGD's own
  result = hj.simulate(loss_fn, params, [batches(w, seed) for w in range(k)], method=method,
                       inner_steps=H, speeds=[1.0] * k, budget=hj.Budget(steps=steps * k),
                       model_state=stats, eval_fn=eval_fn, seed=seed,
                       runtime=hj.simulated_runtime(worker_batching=batching), **options)
  last = [row for row in result.history if row["event"] == "eval"][-1]
  return {"loss": float(last["val_loss"]), "accuracy": float(last["accuracy"]),
          "steps": result.summary["steps"], "cpu": time.process_time() - cpu,
          "wall": time.perf_counter() - wall}


def _mean_sd(values: list[float]) -> tuple[float, float]:
  return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def compare(seeds: int = 5, steps: int = 600, methods: str = "diloco,palsgd",
            k: int = 5) -> dict:
  """Prints every run, then the table per method; returns the verdicts by method and
  metric (True: the gap is within the seed-to-seed sd)."""
  device = jax.devices()[0]
  print(f"# jax {jax.__version__} on {device.device_kind} ({device.platform}); tutorial CNN "
        f"(BatchNorm, Dropout), K = {k} non-IID workers, H = {H}, batch {BATCH}, {steps} "
        f"steps per worker; held-out loss and accuracy at the end (BatchNorm running "
        "statistics)", flush=True)
  print(f"{'method':7} {'seed':>4} {'batching':10} {'loss':>7} {'acc %':>6} {'cpu s':>6} "
        f"{'wall s':>6}", flush=True)
  runs: dict = {}
  for method in methods.split(","):
    for seed in range(seeds):
      for batching in ("vmap", "sequential"):
        r = runs[method, seed, batching] = run(method, seed, batching, steps, k)
        print(f"{method:7} {seed:4d} {batching:10} {r['loss']:7.4f} {100 * r['accuracy']:6.2f} "
              f"{r['cpu']:6.1f} {r['wall']:6.1f}", flush=True)
  print()
  print("| method | metric | vmap mean ± sd | sequential mean ± sd | vmap − sequential per "
        "seed | paired mean ± sd | seed sd | \\|mean\\| ≤ seed sd | paired sd ÷ seed sd |")
  print("|---|---|---|---|---|---|---|---|---|")
  verdicts = {}
  for method in methods.split(","):
    for metric, scale, unit in (("loss", 1.0, ""), ("accuracy", 100.0, " %")):
      of = {b: [scale * runs[method, s, b][metric] for s in range(seeds)]
            for b in ("vmap", "sequential")}
      (mv, sv), (ms, ss) = _mean_sd(of["vmap"]), _mean_sd(of["sequential"])
      paired = [v - s for v, s in zip(of["vmap"], of["sequential"])]
      mp, sp = _mean_sd(paired)
      seed_sd = ((sv ** 2 + ss ** 2) / 2) ** 0.5
      within = abs(mp) <= seed_sd
      verdicts[method, metric] = within
      digits = 4 if metric == "loss" else 2
      print(f"| {method} | {metric}{unit} | {mv:.{digits}f} ± {sv:.{digits}f} | "
            f"{ms:.{digits}f} ± {ss:.{digits}f} | "
            f"{', '.join(f'{p:+.{digits}f}' for p in paired)} | "
            f"{mp:+.{digits}f} ± {sp:.{digits}f} | {seed_sd:.{digits}f} | "
            f"{'yes' if within else '**no**'} | {sp / seed_sd if seed_sd else float('nan'):.2f} |")
  total_cpu = sum(r["cpu"] for r in runs.values())
  total_wall = sum(r["wall"] for r in runs.values())
  print(f"\n{len(runs)} runs: {total_cpu:.0f} s of CPU, {total_wall:.0f} s of wall")
  for method in methods.split(","):
    inside = verdicts[method, "loss"] and verdicts[method, "accuracy"]
    print(f"{method}: the vmap − sequential gap is {'within' if inside else 'OUTSIDE'} the "
          "seed-to-seed spread")
  return {"runs": runs, "verdicts": verdicts}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, default=5, help="seeds 0 .. N-1")
  parser.add_argument("--steps", type=int, default=600, help="steps of each worker")
  parser.add_argument("--methods", default="diloco,palsgd")
  parser.add_argument("--workers", type=int, default=5, help="K")
  args = parser.parse_args()
  compare(args.seeds, args.steps, args.methods, args.workers)


if __name__ == "__main__":
  main()
