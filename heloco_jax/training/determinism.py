"""Bit-exact replay on GPUs: XLA's deterministic GPU ops (docs/DESIGN.md, "Determinism").

On the CPU (and on TPUs) a compiled program gives the same bits on every run.
XLA's GPU reductions and scatters use atomics by default, whose order varies
from run to run, so a GPU run replays bit for bit only when XLA compiles with
``--xla_gpu_deterministic_ops=true``. XLA reads ``XLA_FLAGS`` once, when JAX
starts its backends, so the flag must be in the environment before that.

Who sets it: the user, explicitly, with ``hj.enable_deterministic_ops()`` at
the top of a script (or ``XLA_FLAGS`` in the shell); the CLI's main, which owns
its process, calls ``configure`` at start-up. Library code (``hj.make_engine``,
``hj.simulate``) never writes the process environment: it calls ``require``,
which only checks and says in one line what to do.

The cost (docs/DESIGN.md): the 86M GPT's inner loop runs ~21% slower on an H100,
17% in float32 and 59% in bfloat16 (XLA's attention replaces cuDNN's) on an H200; the
CLI leaves the flag off in bfloat16 unless asked (``harness.deterministic``). Turn it off
(``deterministic=False``) for throughput runs and on real devices, where the arrival order
is not replayable anyway.
"""

from __future__ import annotations

import os

FLAG = "--xla_gpu_deterministic_ops=true"


class DeterminismError(RuntimeError):
  """Deterministic GPU ops were asked for, but JAX's GPU backend runs without them."""


def flag_set() -> bool:
  """Whether ``XLA_FLAGS`` holds the deterministic-ops flag."""
  return FLAG in os.environ.get("XLA_FLAGS", "").split()


def enable() -> None:
  """Adds the flag to ``XLA_FLAGS``; effective only before JAX starts its backends.

  ``hj.enable_deterministic_ops()``: call it at the top of a script, before
  the first array is made, to run ``hj.simulate`` on a GPU with its default
  ``deterministic=True`` (the same as ``XLA_FLAGS=--xla_gpu_deterministic_ops=true``
  in the shell). Nothing in the library calls it for you.
  """
  if not flag_set():
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FLAG}".strip()


def configure(deterministic: bool) -> None:
  """For a program's entry point that owns its process (the CLI's main): ``enable()``
  when ``deterministic``, before JAX starts. Library code calls ``require`` instead."""
  if deterministic:
    enable()


def require(deterministic: bool, name: str = "deterministic") -> None:
  """Checks that this process's GPU computations are deterministic; changes nothing.

  Never writes ``os.environ``. With the flag absent it asks JAX for its
  default backend (``jax.default_backend()``, which starts the backends
  when they have not started yet): CPU and TPU programs replay as they are.

  Args:
    deterministic: False does nothing.
    name: how the message names the setting (a config key or an argument).

  Raises:
    DeterminismError: JAX's default backend is a GPU and ``XLA_FLAGS`` lacks the flag.
  """
  if not deterministic or flag_set():
    return
  import jax  # pylint: disable=g-import-not-at-top
  if jax.default_backend() != "gpu":
    return  # CPU and TPU programs replay bit for bit as they are
  raise DeterminismError(
      f"{name}=True needs XLA's deterministic GPU ops, but JAX's GPU backend runs without "
      f"them; allowed: hj.enable_deterministic_ops() at the top of the script, before the "
      f"first array is made (or XLA_FLAGS={FLAG} in the environment), or {name}=False "
      f"(faster; no bit-exact replay)")
