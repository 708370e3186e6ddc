"""One faulty worker of six, and the aggregation rules that survive it (docs/GUIDE.md, "Robust
aggregation and faulty workers"): a linear regression, worker 0 ascending its own loss (its
batches carry sign = -1), the squared error of the learnt weights under mean() and a robust
rule. About 15 s on 2 CPU cores."""
import jax.numpy as jnp
import numpy as np
import optax

import heloco_jax as hj

W = np.random.default_rng(0).normal(size=(8, 1)).astype(np.float32)


def loss_fn(params, batch):  # batch["sign"] = -1: this worker ascends its own loss
  err = batch["x"] @ params["w"] + params["b"] - batch["y"]
  return batch["sign"] * jnp.mean(err ** 2)


def worker(i, ascends):
  rng = np.random.default_rng(10 + i)
  while True:
    x = rng.normal(size=(16, 8)).astype(np.float32)
    yield {"x": x, "y": x @ W, "sign": np.float32(-1.0 if ascends else 1.0)}


def error(method, aggregate, quorum=1, poisoned=True):
  """The squared error of the learnt weights, and the run's summary."""
  result = hj.simulate(
      loss_fn, {"w": jnp.zeros((8, 1)), "b": jnp.zeros(1)},
      [worker(i, poisoned and i == 0) for i in range(6)],
      method=method, budget=hj.Budget(steps=1200), inner_steps=10, inner_tx=optax.sgd(0.05),
      speeds=[1.0, 1.1, 1.2, 1.3, 1.4, 1.5],
      method_options={"learning_rate": 0.3} if method == "heloco" else None,
      syncer=hj.Syncer(quorum=quorum, aggregate=aggregate))
  return float(np.mean((np.asarray(result.params["w"]) - W) ** 2)), result.summary


for method, quorum, rule in [("diloco", 1, hj.aggregate.trimmed_mean(f=1)),
                             ("heloco", 3, hj.aggregate.median()),
                             ("heloco", 1, hj.aggregate.screen(norm=2.0))]:
  clean, _ = error(method, hj.aggregate.mean(), quorum, poisoned=False)
  poisoned, _ = error(method, hj.aggregate.mean(), quorum)
  robust, summary = error(method, rule, quorum)
  print(f"{method}, quorum {quorum}: clean {clean:.1e}; poisoned: mean() {poisoned:.1e}, "
        f"{rule.name} {robust:.1e} (rejected: {summary['rejected_by'] or 'none'})")
