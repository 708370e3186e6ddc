"""HeLoCo on a non-IID regression task with a flax.nnx MLP (the README's example)."""
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import heloco_jax as hj

model = nnx.Sequential(nnx.Linear(4, 32, rngs=nnx.Rngs(0)), nnx.relu,
                       nnx.Linear(32, 1, rngs=nnx.Rngs(1)))
graphdef, params = nnx.split(model, nnx.Param)

def loss_fn(params, batch):
  x, y = batch
  return jnp.mean((nnx.merge(graphdef, params)(x) - y) ** 2)

w_true = np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)
def worker_data(i, n=64):  # non-IID: worker i only sees inputs shifted by i
  rng = np.random.default_rng(i)
  while True:
    x = rng.normal(i, 1.0, (n, 4)).astype(np.float32)
    yield x, x @ w_true

x_val = np.random.default_rng(9).normal(1.5, 1.5, (256, 4)).astype(np.float32)
result = hj.simulate(
    loss_fn, params, [worker_data(i) for i in range(4)], method="heloco",
    inner_tx=optax.adam(1e-2), inner_steps=10, speeds=[1.0, 1.0, 2.0, 4.0],
    budget=hj.Budget(steps=2_000), eval_fn=lambda p: loss_fn(p, (x_val, x_val @ w_true)))
print(f'{result.summary["initial_val_loss"]:.2f} -> {result.summary["final_val_loss"]:.3f}')
