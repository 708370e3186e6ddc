"""A user's model at the speed of its own loop (issue 79): bare ``nnx.jit`` loop vs ``hj.simulate``.

The model is the test-sized flax.nnx CNN of docs/FLAX_MODELS.md (a 3×3 convolution, BatchNorm,
Dropout, a linear layer) at 28×28, batch 32, on synthetic data made here (``--model tutorial``:
flax's MNIST tutorial CNN, with BatchNorm after each convolution). Its own loop is the
tutorial's: ``nnx.Optimizer`` with AdamW and an ``nnx.jit`` train step. The engine runs the
same number of batch-32 steps (``--steps`` worker-steps in all) with the same AdamW as
``inner_tx``, no evaluation, for K = 1 (ddp, diloco) and K = 5 (one method per family:
ddp, diloco, palsgd, heloco). Each engine run is measured right after a bare run of the same
steps, side by side. Compilation is kept apart: each side is timed (CPU and wall) from the
point where it has compiled (the bare loop: after its first step; the engine: at the first
rows ``on_row`` sees, fetched 4 at a time) to its end, per worker-step; "fixed" is the time
before that point less its steps at that rate (compilation, set-up). The ratio

  bare ÷ engine = bare CPU per step ÷ engine CPU per step

is the steady-state cost of the engine's steps against the user's own (1 = no overhead).
Targets (issue 79): K = 1 >= 0.9, K = 5 >= 0.8. DDP with K workers takes one step on their K
batches together (batch K·32), which XLA:CPU's convolutions run at another cost per example:
its row also prints the bare loop at that batch.

  taskset -c 0 python -m benchmarks.users_model [--steps 600] [--inner-steps 10]
      [--model small|tutorial] [--methods ddp,diloco,palsgd,heloco] [--workers 1,5]

The default run takes about 80 s of CPU on one core; ``--model tutorial --steps 1200`` is
the issue's size (``--steps 300``: about 5 minutes).
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
import optax
from flax import nnx

import heloco_jax as hj

BATCH = 32


class SmallCNN(nnx.Module):
  """docs/FLAX_MODELS.md's CNN at 28×28 and 10 classes."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.dropout = nnx.Dropout(0.3, rngs=rngs)
    self.linear = nnx.Linear(8 * 28 * 28, 10, rngs=rngs)

  def __call__(self, x):
    x = self.dropout(nnx.relu(self.bn(self.conv(x))))
    return self.linear(x.reshape(x.shape[0], -1))


class TutorialCNN(nnx.Module):
  """flax's MNIST tutorial CNN, with BatchNorm after each convolution."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
    self.bn1 = nnx.BatchNorm(32, rngs=rngs)
    self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
    self.bn2 = nnx.BatchNorm(64, rngs=rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)
    self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
    self.linear2 = nnx.Linear(256, 10, rngs=rngs)

  def __call__(self, x):
    pool = lambda y: nnx.avg_pool(y, window_shape=(2, 2), strides=(2, 2))
    x = pool(nnx.relu(self.bn1(self.conv1(x))))
    x = pool(nnx.relu(self.bn2(self.conv2(x))))
    x = self.dropout(nnx.relu(self.linear1(x.reshape(x.shape[0], -1))))
    return self.linear2(x)


MODELS = {"small": SmallCNN, "tutorial": TutorialCNN}


def batches(worker: int, size: int = BATCH):
  """Endless synthetic batches of 28×28 images and 10 labels for ``worker``."""
  rng = np.random.default_rng(worker)
  while True:
    yield (rng.normal(0, 1, (size, 28, 28, 1)).astype(np.float32),
           rng.integers(0, 10, size).astype(np.int32))


def tx() -> optax.GradientTransformation:
  return optax.adamw(1e-3)


class Clock:
  """CPU and wall seconds at marks: (cpu, wall, steps done)."""

  def __init__(self):
    self.marks: list[tuple[float, float, int]] = []

  def mark(self, steps: int) -> None:
    self.marks.append((time.process_time(), time.perf_counter(), steps))

  def steady(self) -> dict:
    """Seconds per step from the first mark after the start (compiled by then) to the end,
    and the fixed cost (the first mark's less its steps at that rate)."""
    (c0, _, _), (c1, w1, s1), (c2, w2, s2) = self.marks[0], self.marks[1], self.marks[-1]
    cpu, wall = (c2 - c1) / (s2 - s1), (w2 - w1) / (s2 - s1)
    return {"cpu": cpu, "wall": wall, "fixed": (c1 - c0) - s1 * cpu}


_STEPS = {}


def bare(model_cls, steps: int, size: int = BATCH) -> dict:
  """The tutorial's own loop: ``nnx.Optimizer`` and an ``nnx.jit`` train step on batches of
  ``size``; the first step compiles."""
  clock = Clock()
  clock.mark(0)
  model = model_cls(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx(), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x, y):
    def loss_fn(model):
      return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  model.train()
  data = batches(0, size)
  for step in range(steps):
    x, y = next(data)
    loss = train_step(model, optimizer, x, y)
    if step == 0:
      jax.block_until_ready(loss)
      clock.mark(1)
  jax.block_until_ready(loss)
  clock.mark(steps)
  return clock.steady()


def engine_loss(model_cls):
  """(``hj.simulate``'s loss_fn of ``model_cls``, its params, its BatchNorm statistics): the
  module split into what trains and what it carries (docs/FLAX_MODELS.md)."""
  graphdef, params, stats, rest = nnx.split(model_cls(nnx.Rngs(0)), nnx.Param, nnx.BatchStat,
                                            ...)

  def loss_fn(params, batch, *, state, rng):
    model = nnx.merge(graphdef, params, state, rest, copy=True)
    nnx.reseed(model, default=rng)
    x, y = batch
    loss = optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
    return loss, (nnx.state(model, nnx.BatchStat), None)
  return loss_fn, params, stats


def engine(model_cls, method: str, k: int, h: int, steps: int) -> dict:
  """The same steps through ``hj.simulate``: K workers of ``h`` inner steps, ``steps``
  worker-steps in all; timed from the first rows the user sees (``on_row``: fetched in bursts
  of ``metrics_fetch_every`` = 4) to the end."""
  clock = Clock()
  clock.mark(0)
  loss_fn, params, stats = engine_loss(model_cls)

  def on_row(row):
    if row["event"] in ("train", "arrival"):
      if len(clock.marks) == 1:
        clock.mark(row["steps"])
      elif len(clock.marks) == 2 and time.perf_counter() - clock.marks[1][1] < 1e-3:
        clock.marks[1] = clock.marks[1][:2] + (row["steps"],)  # the same burst

  options = {} if method == "palsgd" else {"inner_tx": tx()}  # PALSGD's own inner step
  result = hj.simulate(loss_fn, params, [batches(w) for w in range(k)], method=method,
                       inner_steps=h, speeds=[1.0] * k, budget=hj.Budget(steps=steps),
                       model_state=stats, on_row=on_row, metrics_fetch_every=4, **options)
  clock.mark(result.summary["steps"])
  return clock.steady()


def compare(model: str = "small", steps: int = 600, h: int = 10,
            methods: str = "ddp,diloco,palsgd,heloco", workers: str = "1,5") -> dict:
  """Prints the table (one row per method and K) and returns the ratios bare ÷ engine (CPU)
  by "method K", and the worst per K."""
  model_cls = MODELS[model]
  device = jax.devices()[0]
  print(f"# jax {jax.__version__} on {device.device_kind} ({device.platform}); model "
        f"{model}, batch {BATCH}, H = {h}, {steps} worker-steps per run; ms per step after "
        "the first rows (compiled), fixed s = before them less their steps")
  print(f"{'method':8} {'K':>2} {'cpu ms':>7} {'wall ms':>7} {'fixed s':>7} | {'bare cpu':>8} "
        f"{'wall':>6} {'fixed':>6} | {'bare÷engine cpu':>15} {'wall':>5}")
  ratios = {}
  for k in map(int, workers.split(",")):
    for method in methods.split(","):
      if k == 1 and method not in ("ddp", "diloco"):
        continue  # one worker: the step and round families
      b = bare(model_cls, steps)
      e = engine(model_cls, method, k, h, steps)
      ratio, wall_ratio = b["cpu"] / e["cpu"], b["wall"] / e["wall"]
      ratios[f"{method} {k}"] = ratio
      note = ""
      if method == "ddp" and k > 1:  # one step on the K batches together: the same batch bare
        together = bare(model_cls, steps // k, k * BATCH)
        ratios[f"{method} {k} at batch {k * BATCH}"] = together["cpu"] / k / e["cpu"]
        note = (f"  (bare at DDP's batch {k * BATCH}: {1e3 * together['cpu'] / k:.2f} ms per "
                f"{BATCH} examples, ÷ engine {together['cpu'] / k / e['cpu']:.2f})")
      print(f"{method:8} {k:2d} {1e3 * e['cpu']:7.2f} {1e3 * e['wall']:7.2f} {e['fixed']:7.2f} | "
            f"{1e3 * b['cpu']:8.2f} {1e3 * b['wall']:6.2f} {b['fixed']:6.2f} | "
            f"{ratio:15.2f} {wall_ratio:5.2f}{note}", flush=True)
  worst = {}
  for k, target in ((1, 0.9), (5, 0.8)):
    mine = [r for name, r in ratios.items() if name.endswith(f" {k}")]  # the batch-32 loop
    if mine:
      worst[k] = min(mine)
      print(f"K = {k}: worst bare ÷ engine {worst[k]:.2f} (target >= {target})")
  return {"ratios": ratios, "worst": worst}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=600, help="worker-steps of every run")
  parser.add_argument("--inner-steps", type=int, default=10, help="H")
  parser.add_argument("--model", choices=sorted(MODELS), default="small")
  parser.add_argument("--methods", default="ddp,diloco,palsgd,heloco")
  parser.add_argument("--workers", default="1,5")
  args = parser.parse_args()
  compare(args.model, args.steps, args.inner_steps, args.methods, args.workers)


if __name__ == "__main__":
  main()
