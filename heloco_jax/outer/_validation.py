"""Construction-time argument checks shared by the outer rules.

Every check raises ``ValueError`` with one message naming the factory (when
``fn`` is given), the argument, the value given and what is allowed; the run
config's checks (``heloco_jax.cli.configs.validation``) use them with ``fn=None``
and the config key as the name. Values that are JAX tracers
(e.g. under ``optax.inject_hyperparams`` inside ``jit``) cannot be inspected
without a host sync and are accepted as they are.

``optax.inject_hyperparams`` passes every numeric argument as an array:
``concrete_int`` turns a concrete integer array back into the int it holds
(``num_workers``, ``buffer_size``), so that no ``static_args`` are needed; under ``jit``
(a traced init) the rules' static ``ArrivalWeighting`` then reads K from the
hyperparameters (``weighting.INJECTED``).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Sequence

import jax
import numpy as np


def _fail(fn: Optional[str], name: str, value: Any, allowed: str) -> None:
  prefix = f"{fn}: " if fn else ""
  raise ValueError(f"{prefix}{name}={value!r} is not allowed; allowed: {allowed}.")


def _as_float(fn: Optional[str], name: str, value: Any, allowed: str) -> Optional[float]:
  """Returns value as a Python float, or None when it is a tracer."""
  if isinstance(value, jax.core.Tracer):
    return None
  if isinstance(value, bool) or isinstance(value, str):
    _fail(fn, name, value, allowed)
  try:
    return float(value)
  except (TypeError, ValueError):
    _fail(fn, name, value, allowed)


def check_range(
    fn: Optional[str],
    name: str,
    value: Any,
    low: float = -math.inf,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
  """Requires ``low <(=) value <(=) high``; NaN always fails."""
  left = "(" if low_open else "["
  right = ")" if high_open else "]"
  if low == -math.inf and high == math.inf:
    allowed = "a finite number"
  elif high == math.inf:
    allowed = f"a number {'>' if low_open else '>='} {low:g}"
  else:
    allowed = f"a number in {left}{low:g}, {high:g}{right}"
  x = _as_float(fn, name, value, allowed)
  if x is None:
    return
  above = x > low if low_open else x >= low
  below = x < high if high_open else x <= high
  if not (above and below and math.isfinite(x)):
    _fail(fn, name, value, allowed)


def check_learning_rate(fn: str, value: Any) -> None:
  if callable(value):  # a schedule: optax's own wrapper takes it
    _fail(fn, "learning_rate", value, f"a number > 0; for a schedule, optax.inject_hyperparams("
          f"hj.{fn})(learning_rate=schedule, ...)")
  check_range(fn, "learning_rate", value, 0.0, low_open=True)


def check_momentum(fn: str, value: Any) -> None:
  check_range(fn, "momentum", value, 0.0, 1.0, high_open=True)


def check_choice(fn: Optional[str], name: str, value: Any, choices: Sequence[str]) -> None:
  if value not in choices:
    _fail(fn, name, value, "one of " + ", ".join(repr(c) for c in choices))


def concrete_int(value: Any) -> Any:
  """A concrete 0-d integer array as a Python int; any other value unchanged.

  ``optax.inject_hyperparams`` turns every numeric argument into an array
  (``num_workers=4`` arrives as ``Array(4, dtype=int32)``); outside ``jit``
  it is concrete and becomes the int it stands for, so validation and the
  rule see what the user wrote. Tracers, floats and arrays of other shapes
  or dtypes pass unchanged (tracers are accepted as they are; the others
  then fail their check).
  """
  if isinstance(value, jax.core.Tracer) or isinstance(value, (bool, numbers.Integral)):
    return value
  if (isinstance(value, (jax.Array, np.ndarray, np.generic)) and np.ndim(value) == 0
      and np.issubdtype(value.dtype, np.integer)):
    return int(value)
  return value


def check_int(fn: Optional[str], name: str, value: Any, low: int, *,
              allow_none: bool = False) -> None:
  """Requires an integer >= ``low`` (or None when allowed); integer tracers pass."""
  if value is None and allow_none:
    return
  if isinstance(value, jax.core.Tracer) and np.issubdtype(value.dtype, np.integer):
    return
  allowed = f"an integer >= {low}" + (" or None" if allow_none else "")
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
    _fail(fn, name, value, allowed)


def check_positive_int(fn: str, name: str, value: Any, *, allow_none: bool) -> None:
  """Requires an integer >= 1 (or None when allowed)."""
  check_int(fn, name, value, 1, allow_none=allow_none)


def check_float_dtype(fn: str, name: str, value: Any) -> None:
  """Requires None or a floating dtype (``jnp.bfloat16``, ``"float32"``, ``np.dtype(...)``)."""
  if value is None:
    return
  allowed = ("None or a floating dtype such as jnp.float32 or jnp.bfloat16 (with "
             f"optax.inject_hyperparams, name {name!r} in static_args)")
  if isinstance(value, (jax.Array, np.ndarray, numbers.Number)):  # e.g. a schedule's value
    _fail(fn, name, value, allowed)
  try:
    dtype = np.dtype(value)
  except TypeError:
    _fail(fn, name, value, allowed)
  if not jax.numpy.issubdtype(dtype, jax.numpy.floating):
    _fail(fn, name, value, allowed)
