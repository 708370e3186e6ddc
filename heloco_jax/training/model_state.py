"""Model state besides θ, and each worker's randomness (docs/DESIGN.md, "Model state and
randomness").

A flax model holds more than its ``nnx.Param``s: BatchNorm's running statistics
(``nnx.BatchStat``), counters, any ``nnx.Variable`` that is not trained. A ``loss_fn`` that
takes the keyword ``state`` gets each worker's copy and returns the updated one; the inner
loop threads it through the H steps (``inner.InnerLoop``), and the server merges the
workers' copies into one (``ModelStates``), which evaluations see and the result returns:

* ``"mean"`` (the default): a synchronous round averages the copies of the workers it
  accepted, as DiLoCo and FedAvg average everything they average; an asynchronous arrival
  moves the server's copy a 1/K of the way to the arriving worker's,
  ``s ← s + (s_i − s)/K`` (a running mean over arrivals: K arrivals weigh about as much as
  the server's copy); DDP's single copy is the state.
* ``"latest"``: the arriving worker's copy (a round: the first accepted worker's).

Leaves that are not floating point (counters) are never averaged: they take the arriving
(or first accepted) worker's value. Every dispatch starts its worker from the server's copy,
as it starts from θ. With fragments the state is not split: it travels with every
fragment's sync.

A ``loss_fn`` that takes the keyword ``rng`` gets a new key every inner step:
``fold_in(k_w, s)`` for worker w at its own step count s, where
``k_w = fold_in(key(seed), w)`` after a fixed tag — different on every step of every
worker, the same on a replay, and exact on a resume (the step count is checkpointed).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Literal, Optional

import jax
import jax.numpy as jnp
import numpy as np

from heloco_jax.training import checks
from heloco_jax.training import inner as inner_lib

Merge = Literal["mean", "latest"]
MERGES = ("mean", "latest")
# Keeps the workers' keys apart from the run's other streams of the same seed.
_RNG_TAG = 0x6D6F6465  # "mode(l)"


def _variable_types() -> tuple[Any, Any, Any]:
  """(nnx.Variable, nnx.Param, nnx.RngState), or Nones without flax."""
  try:
    from flax import nnx  # pylint: disable=g-import-not-at-top
  except ImportError:  # pragma: no cover  (flax is a dependency)
    return None, None, None
  return nnx.Variable, nnx.Param, nnx.RngState


def check_params_are_trained(params: Any) -> None:
  """Refuses flax variables in ``params`` that are not ``nnx.Param`` (BatchNorm statistics
  given as params: weight decay and the outer momentum would act on them)."""
  variable, param, _ = _variable_types()
  if variable is None:
    return
  for path, leaf in jax.tree_util.tree_leaves_with_path(
      params, is_leaf=lambda x: isinstance(x, variable)):
    if isinstance(leaf, variable) and not isinstance(leaf, param):
      raise ValueError(
          f"params leaf {checks.leaf_path(path)!r} is an nnx.{type(leaf).__name__}, not an nnx.Param: the "
          "optimizers would train it; allowed: params = nnx.state(model, nnx.Param) and the "
          "rest as model_state= (e.g. nnx.state(model, nnx.BatchStat)), with a loss_fn that "
          "takes state= (docs/DESIGN.md, 'Model state and randomness')")


def check_model_state(model_state: Any, contract: inner_lib.LossContract) -> None:
  """``model_state`` goes with a ``loss_fn`` that takes ``state`` (and the other way round),
  and holds no ``nnx.RngState`` (module-held ``nnx.Rngs``: use the ``rng`` keyword)."""
  if model_state is not None and not contract.state:
    raise ValueError("model_state is not allowed with a loss_fn that does not take the keyword "
                     "state; allowed: loss_fn(params, batch, *, state) -> (loss, (new_state, "
                     "metrics)), or model_state=None")
  if model_state is None:
    if contract.state:
      raise ValueError("loss_fn takes the keyword state, but model_state is None; allowed: "
                       "model_state= the initial state (e.g. nnx.state(model, nnx.BatchStat))")
    return
  variable, _, rng_state = _variable_types()
  if variable is not None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(
        model_state, is_leaf=lambda x: isinstance(x, variable)):
      if isinstance(leaf, rng_state):
        raise ValueError(
            f"model_state leaf {checks.leaf_path(path)!r} is an nnx.{type(leaf).__name__} (a module's "
            "nnx.Rngs): workers would share its keys and the checkpoint cannot hold them; "
            "allowed: a loss_fn that takes rng= and reseeds the module each step "
            "(nnx.reseed(model, dropout=rng)), with the Rngs kept out of model_state, e.g. "
            "nnx.state(model, nnx.BatchStat)")
  for path, leaf in jax.tree_util.tree_leaves_with_path(model_state):
    if not hasattr(leaf, "dtype") or jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      raise ValueError(f"model_state leaf {checks.leaf_path(path)!r} is {type(leaf).__name__}; allowed: "
                       "arrays of numbers")


def check_merge(merge: Any) -> None:
  if merge not in MERGES:
    raise ValueError(f"model_state_merge={merge!r} is not allowed; allowed: one of "
                     f"{', '.join(map(repr, MERGES))}")


def worker_rng(seed: int, worker: int) -> np.ndarray:
  """Worker ``worker``'s key data k_w (module docstring)."""
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), _RNG_TAG), worker)
  return np.asarray(jax.random.key_data(key))


def _is_float(x: Any) -> bool:
  return jnp.issubdtype(x.dtype, jnp.floating)


@jax.jit
def _toward(server: Any, arriving: Any, weight: jax.Array) -> Any:
  return jax.tree.map(lambda s, x: s + (x - s) * weight.astype(s.dtype) if _is_float(s) else x,
                      server, arriving)


@jax.jit
def _round_mean(stacked: Any, accepted: jax.Array) -> Any:
  first = jnp.argmax(accepted)
  weights = accepted.astype(jnp.float32) / jnp.maximum(jnp.sum(accepted), 1)
  def mean(x):
    if not _is_float(x):
      return x[first]
    kept = jnp.where(accepted.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0)
    return jnp.tensordot(weights.astype(x.dtype), kept, axes=1)
  return jax.tree.map(mean, stacked)


@jax.jit
def _finite_leaves(tree: Any) -> jax.Array:
  """Whether each floating-point leaf of ``tree`` is finite, as one array (one transfer)."""
  return jnp.stack([jnp.all(jnp.isfinite(x)) if _is_float(x) else jnp.array(True)
                    for x in jax.tree.leaves(tree)])


@dataclasses.dataclass
class ModelStates:
  """The server's copy of the model state and the workers' keys (module docstring).

  Attributes:
    merged: the server's copy (None: the ``loss_fn`` takes no state).
    merge: "mean" or "latest".
    num_workers: K.
    seed: the run's seed (the workers' keys).
    rng: whether the ``loss_fn`` takes ``rng``.
    to_server: moves a tree to where the server's copy lives (the executor's): workers'
      copies come back from their devices before they are merged.
    to_rounds: moves a tree to where a round's (or DDP's) states live (the executor's).
  """
  merged: Any
  merge: str
  num_workers: int
  seed: int
  rng: bool
  to_server: Callable[[Any], Any] = lambda tree: tree
  to_rounds: Callable[[Any], Any] = lambda tree: tree
  warned: bool = False  # of a model state that is not finite (``_check_finite``)

  @property
  def active(self) -> bool:
    return self.merged is not None or self.rng

  def seed_state(self, worker: int) -> inner_lib.InnerState:
    """What worker ``worker``'s first dispatch starts from besides θ."""
    return inner_lib.seed_state(self.merged,
                                worker_rng(self.seed, worker) if self.rng else None)

  def seed_states(self) -> inner_lib.InnerState:
    """``seed_state`` of every worker, stacked (a round's first start)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs),
                        *[self.seed_state(w) for w in range(self.num_workers)])

  def for_dispatch(self, worker: int, previous: Optional[inner_lib.InnerState]
                   ) -> Optional[inner_lib.InnerState]:
    """``previous`` (the worker's state, None before its first dispatch) receiving the
    server's copy of the model state."""
    if not self.active:
      return previous
    if previous is None:
      return self.seed_state(worker)
    return previous._replace(model_state=self.merged)

  def for_round(self, states: Optional[inner_lib.InnerState]) -> Optional[inner_lib.InnerState]:
    """The K stacked states of a round's workers receiving the server's copy (None before the
    first round: their seed states)."""
    if not self.active:
      return states
    if states is None:
      return self.to_rounds(self.seed_states())
    merged = (None if self.merged is None else self.to_rounds(
        jax.tree.map(lambda x, y: jnp.broadcast_to(x, y.shape), self.merged,
                     states.model_state)))
    return states._replace(model_state=merged)

  def for_ddp(self) -> Optional[inner_lib.InnerState]:
    """What DDP's one state starts from besides θ (worker 0's seed state), where it runs."""
    return self.to_rounds(self.seed_state(0)) if self.active else None

  def keyed(self, states: inner_lib.InnerState) -> inner_lib.InnerState:
    """K stacked copies of one state (PALSGD's warm-up → rounds) with each worker's own key."""
    if not self.rng:
      return states
    return states._replace(rng=jnp.stack([worker_rng(self.seed, w)
                                          for w in range(self.num_workers)]))

  def _check_finite(self, merge: str) -> None:
    """Warns once, in one line naming the leaf, when the server's copy stops being finite.
    A loss or an evaluation that reads the state stops the run (rejection); a state that
    neither reads would end the run "done" with NaN in it without a word."""
    if self.warned or self.merged is None or not jax.tree.leaves(self.merged):
      return
    finite = np.asarray(_finite_leaves(self.merged))
    if finite.all():
      return
    self.warned = True
    paths = [checks.leaf_path(path) for path, _ in
             jax.tree_util.tree_leaves_with_path(self.merged)]
    bad = [path for path, ok in zip(paths, finite) if not ok]
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    warnings.warn(f"model_state leaf {bad[0]!r}{more} is not finite (NaN or Inf) after {merge}: "
                  "the loss_fn's new state holds NaN or Inf there, and the server's copy keeps "
                  "it; neither the loss nor the evaluation reads it (or the run would stop), so "
                  "the run goes on and returns it as it is (docs/DESIGN.md, 'Model state and "
                  "randomness')", UserWarning, stacklevel=3)

  def arrive(self, state: inner_lib.InnerState) -> None:
    """An accepted asynchronous arrival's model state merged into the server's copy."""
    if self.merged is None:
      return
    arriving = self.to_server(state.model_state)
    if self.merge == "latest":
      self.merged = arriving
    else:
      self.merged = _toward(self.merged, arriving, jnp.asarray(1.0 / self.num_workers,
                                                               jnp.float32))
    self._check_finite("an arrival's merge")

  def round(self, states: inner_lib.InnerState, accepted: Any) -> None:
    """A round's accepted workers' model states (stacked) merged into the server's copy."""
    if self.merged is None or not np.any(np.asarray(accepted)):
      return
    if self.merge == "latest":
      accepted = np.arange(self.num_workers) == int(np.argmax(np.asarray(accepted)))
    self.merged = self.to_server(_round_mean(states.model_state, jnp.asarray(accepted)))
    self._check_finite("a round's merge")

  def ddp(self, state: inner_lib.InnerState) -> None:
    """DDP's one state is the model state."""
    if self.merged is not None:
      self.merged = self.to_server(state.model_state)
      self._check_finite("a DDP step")
