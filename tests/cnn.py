"""A flax.nnx CNN with BatchNorm and Dropout (the shape of flax's MNIST tutorial, smaller) on
three classes of noisy 6×6 images: the model a JAX researcher brings, shared by the tests of
model state, compressed downloads and Ray (imported by the test modules)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


class CNN(nnx.Module):
  def __init__(self, rngs):
    self.conv = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(4, rngs=rngs)
    self.dropout = nnx.Dropout(0.3, rngs=rngs)
    self.linear = nnx.Linear(4 * 6 * 6, 3, rngs=rngs)

  def __call__(self, x):
    x = self.dropout(nnx.relu(self.bn(self.conv(x))))
    return self.linear(x.reshape(x.shape[0], -1))


MODEL = CNN(nnx.Rngs(0))
GRAPHDEF, PARAMS, STATS, REST = nnx.split(MODEL, nnx.Param, nnx.BatchStat, ...)
CENTRES = np.random.default_rng(0).normal(0, 1, (3, 6, 6, 1)).astype(np.float32)


def _images(n, seed):
  rng = np.random.default_rng(seed)
  y = rng.integers(0, 3, n)
  x = CENTRES[y] + rng.normal(0, 1.5, (n, 6, 6, 1)).astype(np.float32) + 3.0
  return x, y.astype(np.int32)


TEST = _images(300, 999)


def cnn_loss(params, batch, *, state, rng):
  model = nnx.merge(GRAPHDEF, params, state, REST, copy=True)
  nnx.reseed(model, default=rng)
  x, y = batch
  logits = model(x)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  return loss, (nnx.state(model, nnx.BatchStat),
                {"accuracy": jnp.mean(logits.argmax(-1) == y)})


@jax.jit
def cnn_eval(params, *, state):
  model = nnx.merge(GRAPHDEF, params, state, REST, copy=True)
  model.eval()
  logits = model(TEST[0])
  return {"val_loss": optax.softmax_cross_entropy_with_integer_labels(logits, TEST[1]).mean(),
          "accuracy": jnp.mean(logits.argmax(-1) == TEST[1])}


def fsdp_placed(tree, mesh):
  """``tree`` (PARAMS or STATS) FSDP-sharded over ``mesh``'s ``fsdp`` axis (2 or 4 devices):
  the conv kernel and BatchNorm's vectors over their 4 channels, the linear kernel over its
  144 inputs, the 3-class bias replicated; from host values (every process of a
  jax.distributed run places the same)."""
  def spec(x):
    if x.ndim == 4:
      return P(None, None, None, "fsdp")
    return {(4,): P("fsdp"), (144, 3): P("fsdp", None)}.get(x.shape, P())
  return jax.tree.map(lambda x: jax.device_put(np.asarray(x), NamedSharding(mesh, spec(x))),
                      tree)


def cnn_data(workers: int = 2) -> list:
  """Per worker, 80 batches of 16 images."""
  return [[_images(16, 100 * w + i) for i in range(80)] for w in range(workers)]
