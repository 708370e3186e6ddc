"""Look-ahead dispatch point and diagnostics read from an outer state.

Both work on a bare MLA/HeLoCo state or on any state containing one (e.g.
the state of an ``optax.chain``), on device, with no host sync. Like
``optax.contrib.schedule_free_eval_params(state, params)``, the readers take
the state first.

A loop that reads a state at every arrival reads it inside a compiled program
(``find_state`` then walks the tree once, when the program is traced).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from heloco_jax.outer.correction import BRANCH_NAMES, block_names
from heloco_jax.outer.delayed_nesterov import DelayedNesterovState
from heloco_jax.outer.heloco import HeLoCoState
from heloco_jax.outer.mla import MLAState

LOOKAHEAD_STATES = (MLAState, HeLoCoState)
MOMENTUM_STATES = (MLAState, HeLoCoState, DelayedNesterovState, optax.TraceState)


def _find_with_path(state: Any, types: tuple[type, ...], fn: str) -> tuple[Any, Any]:
  """(key path, sub-state) of the single sub-state of one of ``types`` inside ``state``."""
  found = [(path, s) for path, s in jax.tree_util.tree_leaves_with_path(
      state, is_leaf=lambda x: isinstance(x, types)) if isinstance(s, types)]
  names = " or ".join(t.__name__ for t in types)
  if len(found) != 1:
    raise ValueError(
        f"{fn}: state={type(state).__name__} holds {len(found)} {names} "
        f"sub-states; allowed: exactly one, alone or inside an optax.chain's state.")
  return found[0]


def holds_one(tree: Any, types: tuple[type, ...]) -> bool:
  """Whether ``tree`` holds exactly one sub-state of one of ``types``."""
  try:
    find_state(tree, types, "")
  except ValueError:
    return False
  return True


def find_state(state: Any, types: tuple[type, ...], fn: str) -> Any:
  """The single sub-state of one of ``types`` inside ``state`` (walks the whole tree)."""
  return _find_with_path(state, types, fn)[1]


def lookahead_params(state: Any, params: Any) -> Any:
  """The look-ahead dispatch point θ − η·μ·m (ALGORITHMS.md, MLA and HeLoCo).

  The state comes first, as in optax's readers of a state
  (``optax.contrib.schedule_free_eval_params(state, params)``).

  Args:
    state: the state of ``hj.mla`` or ``hj.heloco``, alone or nested in a
      chain's state.
    params: θ, the current global parameters.

  Returns:
    θ − η·μ·m with the structure and dtypes of ``params``; equals θ while
    m = 0.

  Raises:
    ValueError: when ``state`` contains no (or several) MLA/HeLoCo states.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import heloco_jax as hj
    >>> tx = hj.mla(learning_rate=0.5, momentum=0.9)  # num_workers=None: ρ = 1
    >>> params = {"w": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> hj.lookahead_params(state, params)["w"].tolist()  # θ while m = 0
    [0.0, 0.0]
    >>> updates, state = tx.update({"w": jnp.ones(2)}, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> start = hj.lookahead_params(state, params)  # θ − η·μ·m, m = 0.1
    >>> round(float(start["w"][0] - params["w"][0]), 4)
    -0.045
  """
  try:
    outer = find_state(state, LOOKAHEAD_STATES, "lookahead_params")
  except ValueError:
    if holds_one(params, LOOKAHEAD_STATES):  # the order before optax's
      raise ValueError("lookahead_params: the arguments are (state, params), the state "
                       "first as in optax.contrib.schedule_free_eval_params; got the params "
                       "first and the state second.") from None
    raise
  return subtract(params, scaled_momentum(outer))


def scaled_momentum(sub_state: Any) -> Any:
  """η·μ·m of an MLA or HeLoCo state, leaf by leaf: the first pass of ``lookahead_params``."""
  step = sub_state.learning_rate * sub_state.decay
  return jax.tree.map(lambda m: step * m, sub_state.momentum)


def subtract(params: Any, scaled: Any) -> Any:
  """θ − η·μ·m from θ and ``scaled_momentum``, in θ's dtypes: the second pass.

  Two passes, as two separately compiled programs when a server jits them,
  keep θ − η·μ·m rounded twice, as the eager ops do: one fused program lets
  XLA contract it into a fused multiply-add, whose single rounding changes
  the last bit of the dispatch point (and, through the look-ahead's
  sensitivity, a run's numbers).
  """
  return jax.tree.map(lambda p, q: (p - q).astype(jnp.result_type(p)), params, scaled)


def outer_momentum(state: Any) -> Any:
  """The outer momentum m inside an outer state, for alignment diagnostics.

  Args:
    state: the state of ``hj.mla``, ``hj.heloco``, ``hj.delayed_nesterov`` or
      ``hj.async_nesterov`` / ``optax.sgd(..., momentum=μ)`` (optax's trace),
      alone or nested in a chain's state.

  Raises:
    ValueError: when ``state`` holds no (or several) momenta.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import heloco_jax as hj
    >>> tx = optax.chain(optax.clip_by_global_norm(1.0), hj.heloco(0.7, 0.9))
    >>> params = {"w": jnp.zeros(2)}
    >>> _, state = tx.update({"w": jnp.array([0.3, 0.4])}, tx.init(params), params)
    >>> [round(x, 4) for x in hj.outer_momentum(state)["w"].tolist()]  # (1 − μ)·Δ
    [0.03, 0.04]
  """
  return momentum_of(find_state(state, MOMENTUM_STATES, "outer_momentum"))


def momentum_of(sub_state: Any) -> Any:
  """m of one of the ``MOMENTUM_STATES`` (optax's trace calls it ``trace``)."""
  return sub_state.trace if isinstance(sub_state, optax.TraceState) else sub_state.momentum


def _masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean of ``values`` where ``mask``; 0 where no entry is selected."""
  count = jnp.sum(mask)
  return jnp.where(count > 0, jnp.sum(jnp.where(mask, values, 0.0)) / jnp.maximum(count, 1), 0.0)


def heloco_diagnostics(state: Any, *, per_block: bool = True) -> dict[str, jax.Array]:
  """The last arrival's diagnostics as a flat dict of device arrays.

  Keys: ``staleness``, ``weight`` (ρ), ``relative_correction`` (whole tree,
  |G − ρΔ|/|ρΔ|), ``branch_count/<pass|keep|shrink|rotate>``, and

  * ``per_block=True`` (default): per block ``<field>/<block name>`` for
    cosine, confidence, branch, rotation (λ) and shrinkage (β); block names
    are leaf paths such as ``layers/0/mlp/up`` (``tree`` with
    ``scope="tree"``);
  * ``per_block=False``: one number per field instead, as in the engine's
    arrival rows: ``cosine_mean`` (over all blocks), ``rotation_mean`` (λ
    over the blocks that rotated) and ``shrinkage_mean`` (β over the blocks
    that shrank), 0 where no block took that branch.

  Values stay on device; fetch them in batches (``jax.device_get``) when
  logging. Under ``jit`` they are fresh buffers, which outlive a later
  update that donates the state.

  Args:
    state: the state of ``hj.heloco``, alone or nested in a chain's state.
    per_block: one entry per block (default), or the block summaries.

  Returns:
    A dict of scalar ``jax.Array``s.

  Raises:
    ValueError: when ``state`` contains no (or several) HeLoCo states.

  Examples:
    >>> import jax.numpy as jnp
    >>> import heloco_jax as hj
    >>> tx = hj.heloco(0.7, 0.9)
    >>> params = {"b": jnp.zeros(2), "w": jnp.zeros(3)}
    >>> state = tx.init(params)
    >>> _, state = tx.update({"b": jnp.ones(2), "w": jnp.ones(3)}, state, params, staleness=2)
    >>> _, state = tx.update({"b": jnp.ones(2), "w": -jnp.ones(3)}, state, params, staleness=1)
    >>> logs = hj.heloco_diagnostics(state)
    >>> int(logs["staleness"]), int(logs["branch/b"]), int(logs["branch/w"])  # keep, shrink
    (1, 1, 2)
    >>> summary = hj.heloco_diagnostics(state, per_block=False)
    >>> float(summary["cosine_mean"]), round(float(summary["shrinkage_mean"]), 4)
    (0.0, 0.3846)
  """
  outer = find_state(state, (HeLoCoState,), "heloco_diagnostics")
  info = outer.info
  counts = {f"branch_count/{name}": info.branch_counts[i] for i, name in enumerate(BRANCH_NAMES)}
  if not per_block:
    return {
        **counts, "cosine_mean": jnp.mean(info.cosine),
        "rotation_mean": _masked_mean(info.rotation, info.branch == BRANCH_NAMES.index("rotate")),
        "shrinkage_mean": _masked_mean(info.shrinkage,
                                       info.branch == BRANCH_NAMES.index("shrink")),
        "relative_correction": info.total_relative_correction, "weight": outer.weight,
        "staleness": outer.staleness}
  out = {"staleness": outer.staleness, "weight": outer.weight,
         "relative_correction": info.total_relative_correction, **counts}
  leaf_scope = info.cosine.shape[-1] == len(jax.tree.leaves(outer.momentum))
  names = block_names(outer.momentum, "leaf" if leaf_scope else "tree")
  for field in ("cosine", "confidence", "branch", "rotation", "shrinkage"):
    values = getattr(info, field)
    for i, name in enumerate(names):
      out[f"{field}/{name}"] = values[..., i]
  return out
