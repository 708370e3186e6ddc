"""Checks of a user's problem before any work: errors name the argument, the leaf, the worker.

``make_engine`` calls these on ``params``, ``loss_fn`` (on worker 0's first
batch, without consuming it) and a user's ``outer_tx``, so that a mistake is
one line naming what to change instead of a traceback from deep inside JAX or
flax. Errors raised later, inside a worker's steps, are re-raised by the
engine with the worker and its step (``worker_error``).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import marshal
import warnings
from typing import Any

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np

from heloco_jax.outer.lookahead import LOOKAHEAD_STATES  # those that give θ − η·μ·m
from heloco_jax.outer.weighting import arrival_weighting


def leaf_path(path: Any) -> str:
  """A pytree key path as ``a/b/0`` (error messages name leaves this way)."""
  return jax.tree_util.keystr(path, simple=True, separator="/") or "(the root)"


def describe_tree(tree: Any) -> str:
  """``a: (8, 3) float32, b: (8,) int32`` for a pytree of arrays (error messages)."""
  return ", ".join(f"{leaf_path(p)}: {tuple(np.shape(x))} {getattr(x, 'dtype', type(x).__name__)}"
                   for p, x in jax.tree_util.tree_leaves_with_path(tree))


def check_params(params: Any) -> None:
  """Every leaf of ``params`` a floating-point array (the outer and inner rules differentiate
  and average them)."""
  leaves = jax.tree_util.tree_leaves_with_path(params)
  if not leaves:
    raise ValueError("params holds no arrays; allowed: a pytree of floating-point arrays")
  for path, leaf in leaves:
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(
          f"params leaf {leaf_path(path)!r} has dtype {dtype or type(leaf).__name__}; allowed: "
          "floating-point arrays only (keep integer state such as step counters or "
          "BatchNorm statistics out of params)")


def takes_keyword(fn: Any, name: str) -> bool:
  """Whether ``fn``'s signature has a parameter ``name`` (False where it cannot be read)."""
  try:
    return name in inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False


def check_loss_fn(loss_fn: Any, params: Any, batch: Any, model_state: Any = None) -> None:
  """``loss_fn(params, batch)`` traces on ``batch`` (worker 0's first) to a scalar loss or
  ``(scalar loss, aux)``; one that takes ``state`` (and ``rng``) to ``(loss, (new_state,
  metrics))`` whose new state has the structure, shapes and dtypes of ``model_state``; and
  one that draws random numbers does so from the ``rng`` it takes (docs/DESIGN.md, "Model
  state and randomness")."""
  from heloco_jax.training import inner  # pylint: disable=g-import-not-at-top
  contract = inner.LossContract.of(loss_fn)
  rng = jax.random.key(0) if contract.rng else None
  call = f"loss_fn(params, batch{', state=...' * contract.state}{', rng=...' * contract.rng})"
  def traced(params, model_state, rng):
    return contract.call(loss_fn, params, batch, model_state, rng)
  try:
    out = jax.eval_shape(traced, params, model_state, rng)
  except Exception as error:  # pylint: disable=broad-except
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    raise ValueError(
        f"{call} fails on worker 0's first batch ({describe_tree(batch)}): "
        f"{type(error).__name__}: {first}") from error
  if contract.state:
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], tuple)
            and len(out[1]) == 2):
      raise ValueError(f"{call} returned {type(out).__name__}; allowed: (loss, (new_state, "
                       "metrics)) for a loss_fn that takes state (metrics: a dict of scalars, "
                       "or None)")
    new_state = out[1][0]
    want = jax.tree.map(lambda x: (np.shape(x), np.dtype(x.dtype)), model_state)
    got = jax.tree.map(lambda x: (np.shape(x), np.dtype(x.dtype)), new_state)
    if jax.tree.structure(new_state) != jax.tree.structure(model_state) or want != got:
      raise ValueError(f"{call} returned a new state ({describe_tree(new_state)}) unlike "
                       f"model_state ({describe_tree(model_state)}); allowed: the same "
                       "structure, shapes and dtypes (e.g. nnx.state(model, nnx.BatchStat) "
                       "after the forward pass)")
  if _draws_from_a_held_key(lambda p, s, b, r: contract.call(loss_fn, p, b, s, r), params,
                            model_state, batch, rng):
    if contract.rng:
      raise ValueError(
          "loss_fn takes rng but also draws random numbers from a key it holds (e.g. an "
          "nnx.Rngs stream it does not reseed: nnx.Dropout draws from 'dropout' when the "
          "Rngs has one, not from 'default'), so those draws are the same at every step of "
          "every worker; allowed: derive every draw from rng, e.g. nnx.reseed(model, "
          "dropout=rng) for each stream it draws from (docs/DESIGN.md, 'Model state and "
          "randomness')")
    raise ValueError(
        "loss_fn draws random numbers from a key it holds (e.g. nnx.Dropout with the "
        "module's own nnx.Rngs), so every step of every worker would draw the same ones; "
        "allowed: take the keyword rng (a new key every inner step) and use it, e.g. "
        "nnx.reseed(model, dropout=rng) (docs/DESIGN.md, 'Model state and randomness')")
  loss = out[0] if isinstance(out, tuple) else out
  metrics = out[1][1] if contract.state else (out[1] if isinstance(out, tuple) else None)
  if isinstance(metrics, dict):  # names that meet or are empty: one line (S1, issue 78)
    metric_names(metrics, call)
  if isinstance(metrics, dict) and inner.is_metric(inner.metric_leaves(metrics).get("loss")):
    raise ValueError(
        f"{call}'s metrics hold 'loss', which would be written over train_loss (the mean of "
        "the loss it returns); allowed: another name (e.g. 'loss_unregularized'), or leave it "
        "out: train_loss is written anyway")
  if not (hasattr(loss, "shape") and loss.shape == () and jnp.issubdtype(loss.dtype,
                                                                          jnp.floating)):
    got = (f"shape {tuple(loss.shape)} {loss.dtype}" if hasattr(loss, "shape")
           else type(loss).__name__)
    raise ValueError(
        f"loss_fn returned {got} on worker 0's first batch; allowed: a scalar floating-point "
        "loss, or (loss, aux) (e.g. take the mean over the batch)")


_DRAWS = ("random_bits", "threefry2x32")  # the primitives that make random numbers


def _draws_from_a_held_key(fn: Any, params: Any, model_state: Any, batch: Any,
                           rng: Any) -> bool:
  """Whether tracing ``fn(params, model_state, batch, rng)`` draws random numbers from a
  key that derives from neither the batch (a pipeline's per-example keys) nor ``rng``,
  nested calls included: a data-flow walk of the jaxpr from those arguments."""
  try:
    closed = jax.make_jaxpr(fn)(params, model_state, batch, rng)
  except Exception:  # pylint: disable=broad-except  (eval_shape above already traced it)
    return False
  held_leaves = len(jax.tree.leaves(params)) + len(jax.tree.leaves(model_state))
  def held(jaxpr: Any, derived: set) -> bool:
    for eqn in jaxpr.eqns:
      ins = [not isinstance(v, jax_core.Literal) and v in derived for v in eqn.invars]
      if eqn.primitive.name in _DRAWS and not any(ins):
        return True
      for sub in _sub_jaxprs(eqn.params):
        # A sub-jaxpr takes the tail of the call's operands (a call, scan and remat all of
        # them; cond all but the index; while's body all but the cond's consts).
        tail = ins[len(ins) - len(sub.invars):] if len(sub.invars) <= len(ins) else []
        if held(sub, {v for v, d in zip(sub.invars, tail) if d}):
          return True
      if any(ins):
        derived.update(eqn.outvars)
    return False
  return held(closed.jaxpr, set(closed.jaxpr.invars[held_leaves:]))


def _sub_jaxprs(params: dict[str, Any]) -> list[Any]:
  found = []
  for value in params.values():
    for item in (value if isinstance(value, (list, tuple)) else (value,)):
      inner = getattr(item, "jaxpr", item)
      if hasattr(inner, "eqns"):
        found.append(inner)
  return found


def _has(state: Any, types: tuple[type, ...]) -> bool:
  found = jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, types))
  return any(isinstance(x, types) for x in found)


def check_outer_tx(outer_tx: Any, params: Any, method: Any, lookahead: bool) -> None:
  """A user's ``outer_tx`` holds what ``method`` reads from it, or a one-line refusal.

  An asynchronous method weighs each arrival by ρ (1/√K by default): a rule
  without an arrival weight (e.g. ``optax.sgd``) would silently drop it. A
  look-ahead dispatch (heloco; mla with ``lookahead_dispatch=True``) reads η, μ
  and m from an ``hj.heloco`` or ``hj.mla`` state.
  """
  state = jax.eval_shape(outer_tx.init, params)
  if method.synchrony == "async" and not arrival_weighting(state).weightings:
    raise ValueError(
        f"outer_tx holds no arrival weight ρ, which method={method.name!r} applies to every "
        "arrival (ρ = 1/√K by default); allowed: a chain with hj.scale_by_arrival_weight("
        "num_workers=K) (or num_workers=None for ρ = 1) before your rule, one of "
        "hj.async_nesterov, hj.delayed_nesterov, hj.mla, hj.heloco, or outer_tx=None")
  if lookahead and not _has(state, LOOKAHEAD_STATES):
    why = ("heloco always dispatches" if method.lookahead == "always"
           else "lookahead_dispatch=True dispatches")
    raise ValueError(
        f"outer_tx is not allowed with method={method.name!r}: {why} workers from the "
        "look-ahead point θ − η·μ·m, whose η, μ and m come from an hj.heloco (or hj.mla) "
        "state; allowed: outer_tx=None (the method's rule) or a chain holding "
        f"hj.{'heloco' if method.name == 'heloco' else 'mla'}(...)")


def check_batch(worker: int, index: int, batch: Any, first: Any) -> None:
  """``batch`` (worker ``worker``'s ``index``-th) has the structure and shapes of ``first``
  (the first batch of the run)."""
  if jax.tree.structure(batch) != jax.tree.structure(first):
    raise ValueError(
        f"worker {worker}'s batch {index} has the structure {jax.tree.structure(batch)}; "
        f"allowed: that of the first batch, {jax.tree.structure(first)}")
  for (path, leaf), want in zip(jax.tree_util.tree_leaves_with_path(batch),
                                jax.tree.leaves(first)):
    if np.shape(leaf) != np.shape(want) or np.result_type(leaf) != np.result_type(want):
      raise ValueError(
          f"worker {worker}'s batch {index} has leaf {leaf_path(path)!r} of shape "
          f"{tuple(np.shape(leaf))} {np.result_type(leaf)}; allowed: the first batch's, "
          f"{tuple(np.shape(want))} {np.result_type(want)} (every inner step of every worker "
          "takes one batch shape)")


def check_eval_fn(eval_fn: Any, model_state: Any) -> None:
  """``eval_fn(params, *, state)`` goes with ``model_state`` (a one-line refusal without it);
  an ``eval_fn`` without ``state`` beside a ``model_state`` is warned of once: its
  evaluations do not see the run's model state (docs/FLAX_MODELS.md)."""
  if eval_fn is None:
    return
  if not callable(eval_fn):
    raise ValueError(f"eval_fn={eval_fn!r} is not allowed; allowed: None or a function "
                     "params -> loss (or -> a dict with 'val_loss')")
  try:
    state = inspect.signature(eval_fn).parameters.get("state")
  except (TypeError, ValueError):
    return
  if model_state is None and state is not None and state.default is inspect.Parameter.empty:
    raise ValueError("eval_fn takes the keyword state, but model_state is None; allowed: "
                     "model_state= the initial state (with a loss_fn that takes state), or "
                     "an eval_fn(params) without state")
  if model_state is not None and state is None:
    warnings.warn("eval_fn does not take the keyword state, so its evaluations do not see the "
                  "run's model_state (e.g. BatchNorm statistics); eval_fn(params, *, state) "
                  "gets the server's copy (docs/FLAX_MODELS.md)", stacklevel=3)


def metric_names(metrics: dict, who: str) -> dict[str, Any]:
  """A metrics dict's values by name, a nested dict's as ``outer/inner`` (docs/DESIGN.md,
  "Model state and randomness"), every value kept (None too, for the caller to judge).

  Raises:
    ValueError: an empty name, or two names that meet (``{"a/b": 1, "a": {"b": 2}}`` would
      both be written as ``a/b``, one over the other).
  """
  out: dict[str, Any] = {}
  def walk(tree: dict, prefix: str) -> None:
    for key, value in tree.items():
      if str(key) == "":
        raise ValueError(f"{who} returned a metric named '' (in {prefix[:-1] or 'the dict'!r}"
                         "); allowed: non-empty names")
      name = prefix + str(key)
      if isinstance(value, dict):
        walk(value, name + "/")
      elif name in out:
        raise ValueError(f"{who} returned two metrics named {name!r} (a nested dict's "
                         f"'/'-joined name and a flat one); allowed: names that differ")
      else:
        out[name] = value
  walk(metrics, "")
  return out


def _real_scalar(value: Any) -> bool:
  """A real number (integer, floating point or boolean) of shape ()."""
  from heloco_jax.training import inner  # pylint: disable=g-import-not-at-top
  if not inner.is_metric(value):
    return False
  dtype = value.dtype if hasattr(value, "dtype") else jnp.result_type(value)
  return not jnp.issubdtype(dtype, jnp.complexfloating)


def _what(value: Any) -> str:
  """How an error names a value that is not a real scalar."""
  if value is None:
    return "None"
  if hasattr(value, "dtype") and np.shape(value) == ():
    return str(value.dtype)
  if hasattr(value, "shape"):
    return f"of shape {tuple(np.shape(value))}"
  if isinstance(value, complex):
    return "complex128"
  return f"a {type(value).__name__}"


def eval_metrics(value: Any) -> dict[str, float]:
  """An ``eval_fn``'s result as ``{"val_loss": ..., ...}`` of Python floats: a real scalar
  loss, or a dict of real scalars (nested dicts' by ``outer/inner``) holding ``val_loss``.
  Every value is checked here, at the first evaluation, before any training."""
  value = jax.device_get(value)
  if not isinstance(value, dict):
    if value is None or isinstance(value, (tuple, list, str, bytes)):
      raise ValueError(f"eval_fn returned {_what(value)}; allowed: a real scalar loss, or a "
                       "dict holding it as 'val_loss' (and any other real scalars)")
    value = {"val_loss": value}
  elif "val_loss" not in value:
    raise ValueError(f"eval_fn returned a dict with keys {sorted(map(str, value))}; allowed: a "
                     "scalar loss, or a dict holding it as 'val_loss' (and any other scalars)")
  if isinstance(value["val_loss"], dict):
    raise ValueError("eval_fn returned 'val_loss' a dict; allowed: a real scalar loss as "
                     "'val_loss'")
  metrics = {}
  for key, v in metric_names(value, "eval_fn").items():
    if not _real_scalar(v):
      raise ValueError(f"eval_fn returned {key!r} {_what(v)}; allowed: real scalars only (a "
                       "loss, or a dict of real scalars with 'val_loss')")
    metrics[key] = float(v)
  return metrics


def _digest(value: Any) -> str:
  return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def _closure_values(fn: Any, depth: int = 4) -> list[Any]:
  """The numbers and strings a transform's or function's closures hold (its hyperparameters,
  best-effort): an optax transform's ``update`` closes over its learning rate, momentum, ...
  and over the transforms it chains."""
  if depth == 0:
    return []
  if isinstance(fn, functools.partial):
    return _closure_values(fn.func, depth) + [type(a).__name__ for a in fn.args]
  if hasattr(fn, "update") and hasattr(fn, "init"):  # an optax transform
    return _closure_values(fn.update, depth)
  values: list[Any] = []
  for cell in getattr(fn, "__closure__", None) or ():
    try:
      value = cell.cell_contents
    except ValueError:
      continue
    if isinstance(value, (bool, int, float, str)) or value is None:
      values.append(value)
    elif isinstance(value, (tuple, list)):
      for item in value:
        values += ([item] if isinstance(item, (bool, int, float, str))
                   else _closure_values(item, depth - 1))
    elif callable(value):
      values += _closure_values(value, depth - 1)
  return values


def function_fingerprint(fn: Any) -> str:
  """Best-effort: a function's qualified name and a hash of its code (a ``functools.partial``:
  its function's, with its arguments' types)."""
  inner = fn.func if isinstance(fn, functools.partial) else fn
  code = getattr(inner, "__code__", None)
  name = f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', type(inner).__name__)}"
  body = marshal.dumps(code) if code is not None else repr(type(inner)).encode()
  return f"{name}:{hashlib.sha256(body).hexdigest()[:16]}"


def tree_fingerprint(tree: Any) -> dict[str, Any]:
  """A pytree's structure (hashed) and its leaves' dtypes and shapes."""
  leaves, treedef = jax.tree.flatten(tree)
  return {"structure": _digest(str(treedef)),
          "leaves": _digest([[str(getattr(x, "dtype", type(x).__name__)), list(np.shape(x))]
                             for x in leaves])}


def fingerprint(loss_fn: Any, params: Any, first_batches: list[Any], outer_tx: Any,
                inner_tx: Any, compressor: Any = None, download_compressor: Any = None
                ) -> dict[str, Any]:
  """What a run is, beyond its settings (a workdir refuses to resume another): the loss
  function, the params' and each worker's first batch's structure, shapes and dtypes, the
  outer and inner transforms' state structures and hyperparameters (best-effort), and each
  compressor's state and payload structures and options, when there is one."""
  def transform(tx):
    if tx is None:
      return None
    return {"state": tree_fingerprint(jax.eval_shape(tx.init, params)),
            "hyperparameters": _digest(_closure_values(tx))}
  run = {"loss_fn": function_fingerprint(loss_fn), "params": tree_fingerprint(params),
         "first_batches": [tree_fingerprint(batch) for batch in first_batches],
         "outer_tx": transform(outer_tx), "inner_tx": transform(inner_tx)}
  # Each key only with its compressor: earlier workdirs resume as before.
  for key, c in (("compress", compressor), ("compress_download", download_compressor)):
    if c is not None:
      state = jax.eval_shape(c.init, params)
      run[key] = {"state": tree_fingerprint(state),
                  "payload": tree_fingerprint(jax.eval_shape(c.compress, params, state)[0]),
                  "options": _digest(_closure_values(c.compress))}
  return run
