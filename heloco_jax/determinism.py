"""Bit-exact replay on GPUs: XLA's deterministic GPU ops (docs/DESIGN.md, "Determinism").

On the CPU (and on TPUs) a compiled program gives the same bits on every run.
XLA's GPU reductions and scatters use atomics by default, whose order varies
from run to run, so a GPU run replays bit for bit only when XLA compiles with
``--xla_gpu_deterministic_ops=true``. XLA reads ``XLA_FLAGS`` once, when JAX
starts its backends; ``require`` therefore sets the flag before that, or says
in one line that it is too late.

The cost, measured on an H100 (docs/DESIGN.md): the 86M GPT's inner loop
runs ~21% slower. Turn it off (``deterministic=False``) for throughput runs
and on real devices, where the arrival order is not replayable anyway.
"""

from __future__ import annotations

import os

FLAG = "--xla_gpu_deterministic_ops=true"


class DeterminismError(RuntimeError):
  """Deterministic GPU ops were asked for after JAX's GPU backend had started without them."""


def flag_set() -> bool:
  """Whether ``XLA_FLAGS`` holds the deterministic-ops flag."""
  return FLAG in os.environ.get("XLA_FLAGS", "").split()


def enable() -> None:
  """Adds the flag to ``XLA_FLAGS``; effective only before JAX starts its backends.

  Call it at the top of a script (before creating any array) to run
  ``hj.simulate`` on a GPU with its default ``deterministic=True``.
  """
  if not flag_set():
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FLAG}".strip()


def _backends_started() -> bool:
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  started = getattr(xla_bridge, "backends_are_initialized", None)
  return True if started is None else started()


def require(deterministic: bool, name: str = "deterministic") -> None:
  """Makes this process's GPU computations deterministic, or fails in one line.

  Args:
    deterministic: False does nothing.
    name: how the message names the setting (a config key or an argument).

  Raises:
    DeterminismError: JAX's GPU backend has started without the flag.
  """
  if not deterministic or flag_set():
    return
  if not _backends_started():
    enable()
    return
  import jax  # pylint: disable=g-import-not-at-top
  if jax.default_backend() != "gpu":
    return  # CPU and TPU programs replay bit for bit as they are
  raise DeterminismError(
      f"{name}=True needs XLA's deterministic GPU ops, but JAX's GPU backend started without "
      f"them; allowed: XLA_FLAGS={FLAG} in the environment (or hj.enable_deterministic_ops() "
      f"before the first array is made), or {name}=False (faster; no bit-exact replay)")
