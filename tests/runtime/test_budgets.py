"""Issue 79, item 3: budgets that hold. No method computes work its budget cannot apply: the
loss calls a run makes (counted by a host callback, in worker-steps) are the steps it applied
(PALSGD: also the pseudo-sync steps of its applied rounds, which evaluate the loss but read no
batch and count no step). Every method of the registry, a step budget that ends mid-round."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import heloco_jax as hj
from heloco_jax.training import methods

K, H, B = 2, 4, 8
W = np.array([[1.0], [-2.0], [0.5]], np.float32)
PARAMS = {"a": jnp.full((3, 4), 0.1, jnp.float32), "b": jnp.full((4, 1), 0.1, jnp.float32)}


def _data(worker):
  rng = np.random.default_rng(worker)
  while True:
    x = rng.normal(worker, 1, (B, 3)).astype(np.float32)
    yield x, x @ W


def _counted(method, budget, **options):
  """(summary, worker-steps whose loss was computed) of a run of ``method``."""
  examples = []

  def loss(params, batch):
    x, y = batch
    jax.debug.callback(lambda y: examples.append(y.shape[0]), y)  # per worker under vmap
    return jnp.mean((jnp.tanh(x @ params["a"]) @ params["b"] - y) ** 2)

  result = hj.simulate(loss, PARAMS, [_data(i) for i in range(K)], method=method,
                       inner_steps=H, budget=budget, **options)
  jax.effects_barrier()
  return result.summary, sum(examples) // B


@pytest.mark.parametrize("method", sorted(methods.METHODS))
@pytest.mark.parametrize("speeds", ["homogeneous", "mixed"])
def test_no_method_computes_steps_beyond_its_step_budget(method, speeds):
  budget = 2 * K * H + 3  # two rounds fit, the third would pass it
  summary, computed = _counted(method, hj.Budget(steps=budget), speeds=speeds)
  assert 0 < summary["steps"] <= budget
  if methods.METHODS[method].inner == "palsgd":  # DDP warm-up of H steps, then rounds
    rounds = summary["outer_updates"] - H
    assert computed == K * H + rounds * K * H, (computed, summary)
    assert summary["steps"] <= K * H + rounds * K * H
  else:
    assert computed == summary["steps"], (computed, summary)


@pytest.mark.parametrize("method", ["diloco", "palsgd", "local_sgd"])
def test_no_round_is_computed_beyond_a_simulated_seconds_budget(method):
  # homogeneous workers: a step is 1 simulated second, a round H plus its all-reduce
  summary, computed = _counted(method, hj.Budget(sim_seconds=2.5 * H + 0.5),
                               speeds="homogeneous")
  assert summary["sim_time"] <= 2.5 * H + 0.5
  if method == "palsgd":
    assert computed == K * H + (summary["outer_updates"] - H) * K * H, (computed, summary)
  else:
    assert computed == summary["steps"], (computed, summary)
