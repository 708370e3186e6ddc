"""Look-ahead dispatch point and diagnostics read from an outer state.

Both work on a bare MLA/HeLoCo state or on any state containing one (e.g.
the state of an ``optax.chain``), on device, with no host sync. Like
``optax.contrib.schedule_free_eval_params(state, params)``, the readers take
the state first.
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


def _holds_one(tree: Any, types: tuple[type, ...]) -> bool:
  try:
    find_state(tree, types, "")
  except ValueError:
    return False
  return True


def find_state(state: Any, types: tuple[type, ...], fn: str) -> Any:
  """The single sub-state of one of ``types`` inside ``state``."""
  found = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, types))
           if isinstance(s, types)]
  names = " or ".join(t.__name__ for t in types)
  if len(found) != 1:
    raise ValueError(
        f"{fn}: state={type(state).__name__} holds {len(found)} {names} "
        f"sub-states; allowed: exactly one, alone or inside an optax.chain's state.")
  return found[0]


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
    if _holds_one(params, LOOKAHEAD_STATES):  # the order before optax's
      raise ValueError("lookahead_params: the arguments are (state, params), the state "
                       "first as in optax.contrib.schedule_free_eval_params; got the params "
                       "first and the state second.") from None
    raise
  step = outer.learning_rate * outer.decay
  return jax.tree.map(lambda p, m: (p - step * m).astype(jnp.result_type(p)),
                      params, outer.momentum)


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
  found = find_state(state, (MLAState, HeLoCoState, DelayedNesterovState, optax.TraceState),
                     "outer_momentum")
  return found.trace if isinstance(found, optax.TraceState) else found.momentum


def heloco_diagnostics(state: Any) -> dict[str, jax.Array]:
  """The last arrival's diagnostics as a flat dict of device arrays.

  Keys: ``staleness``, ``weight`` (ρ), ``relative_correction`` (whole tree,
  |G − ρΔ|/|ρΔ|), ``branch_count/<pass|keep|shrink|rotate>``, and per block
  ``<field>/<block name>`` for cosine, confidence, branch, rotation (λ) and
  shrinkage (β); block names are leaf paths such as ``layers/0/mlp/up``
  (``tree`` with ``scope="tree"``). Values stay on device; fetch them in
  batches (``jax.device_get``) when logging.

  Args:
    state: the state of ``hj.heloco``, alone or nested in a chain's state.

  Returns:
    A dict of scalar ``jax.Array``s.
  """
  outer = find_state(state, (HeLoCoState,), "heloco_diagnostics")
  info = outer.info
  out = {"staleness": outer.staleness, "weight": outer.weight,
         "relative_correction": info.total_relative_correction}
  for i, name in enumerate(BRANCH_NAMES):
    out[f"branch_count/{name}"] = info.branch_counts[i]
  leaf_scope = info.cosine.shape[-1] == len(jax.tree.leaves(outer.momentum))
  names = block_names(outer.momentum, "leaf" if leaf_scope else "tree")
  for field in ("cosine", "confidence", "branch", "rotation", "shrinkage"):
    values = getattr(info, field)
    for i, name in enumerate(names):
      out[f"{field}/{name}"] = values[..., i]
  return out
