"""The small model and data the engine-level tests share, how they run it (``simulate``: the
CLI's engine, ``harness.engine_of_config``), and a warning filter two checkpoint tests share
(imported by the test modules)."""

import asyncio
import functools
import os
import socket
import subprocess
from typing import Optional

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from heloco_jax.cli.configs import default
from heloco_jax.lm import data, harness

H, BATCH, CONTEXT = 2, 4, 16


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a subprocess on ``devices`` host CPU devices, with the suite's own
  (tests/conftest.py: LLVM -O0 for the tiny programs, deterministic GPU ops)."""
  return os.environ["XLA_FLAGS"] + f" --xla_force_host_platform_device_count={devices}"


def once(args):
  """``args`` with each flag once, at its last value: tests override a shared list of flags,
  and the CLI refuses a flag given twice (which value was meant?)."""
  last = {arg.split("=", 1)[0]: i for i, arg in enumerate(args)}
  return [arg for i, arg in enumerate(args) if last[arg.split("=", 1)[0]] == i]


def free_port() -> int:
  """A TCP port free on this host now (a jax.distributed coordinator's)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_processes(commands, env=None, timeout=300):
  """Runs ``commands`` (one per jax.distributed process) at once; (return codes, outputs)."""
  procs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True) for command in commands]
  try:
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  return [p.returncode for p in procs], outputs


# Reading a truncated checkpoint fails in one of orbax's concurrent tensorstore reads; orbax
# then closes its event loop while the others are in flight, and when one of them finishes,
# tensorstore's callback into the closed loop is reported as an unraisable "Event loop is
# closed" (intermittently, a race inside orbax 0.12 / tensorstore 0.1). It is harmless: the
# fallback to the older checkpoint is complete. Only the tests that truncate one expect it.
ORBAX_CLOSED_LOOP_AFTER_A_FAILED_READ = pytest.mark.filterwarnings(
    "ignore:(?s)Exception ignored in. None.*Event loop is closed"
    ":pytest.PytestUnraisableExceptionWarning")


@functools.lru_cache(maxsize=None)
def dataset(num_workers: int, partition: str = "non_iid") -> data.Data:
  """Synthetic languages, context 16, batch 4; cached across tests."""
  return data.make_data(num_workers=num_workers, partition=partition, context=CONTEXT,
                        batch_size=BATCH, val_sequences_per_language=8,
                        max_bytes_per_language=40_000)


def config(method: str = "mla", num_workers: int = 3, **overrides) -> ml_collections.ConfigDict:
  """The quickstart config on a 1-layer d_model 32 GPT, H = 2, severe paces (very stale
  arrivals, which the tests were written for), no budget or evals by default.

  ``overrides`` use dotted keys: ``config("diloco", **{"budget.tokens": 512})``.
  """
  c = default.get_config()
  c.method, c.num_workers = method, num_workers
  c.model.d_model, c.model.num_layers, c.model.num_heads, c.model.context = 32, 1, 4, CONTEXT
  c.batch_size, c.inner_steps, c.speeds = BATCH, H, "severe"
  c.inner.warmup_steps, c.inner.total_steps = 2, 400
  c.budget.tokens, c.budget.eval_every_tokens = 0, 0
  for key, value in overrides.items():
    node = c
    *parents, leaf = key.split(".")
    for parent in parents:
      node = node[parent]
    if leaf not in node:  # (a ConfigDict would take a new key silently)
      raise KeyError(f"tiny.config: {key!r} is no config key")
    node[leaf] = value
  if c.runtime != "simulated" and "speeds" not in overrides:
    c.speeds = default.get_config().speeds  # a real clock refuses simulated paces
  return c


def simulate(config: ml_collections.ConfigDict, shards: Optional[data.Data] = None,
             on_row=None, **overrides) -> tuple[dict, list[dict]]:
  """(summary, rows) of ``config``'s run on the engine the CLI builds (``harness.engine_of_config``),
  on ``shards`` (default: ``dataset(config.num_workers)``); ``overrides`` replace
  ``hj.make_engine`` keywords (e.g. ``runtime=`` a fault-injecting runtime of tests/faults.py)."""
  engine, _ = harness.engine_of_config(config, shards or dataset(config.num_workers), **overrides)
  try:
    summary = asyncio.run(engine.run(on_row))
  finally:
    engine.close()
  return summary, engine.rows


def stop_after_rows(engine, rows: int) -> None:
  """Runs ``engine`` until its ``rows``-th row, stops it there (``hj.Stopped``, after a
  checkpoint with a workdir) and closes it: a workdir holding an interrupted run."""
  from heloco_jax.runtime import engine as engine_lib  # pylint: disable=g-import-not-at-top
  seen = []

  def stop(row):
    seen.append(row)
    if len(seen) == rows:
      engine.request_stop("test")
  with pytest.raises(engine_lib.Stopped):
    asyncio.run(engine.run(stop))
  engine.close()


def regression_loss(params, batch):
  """A one-hidden-layer regression: the engine-level tests that need no language model."""
  x, y = batch
  return jnp.mean((jnp.tanh(x @ params["w"]) @ params["v"] - y) ** 2)


def regression_params(inputs: int = 64, hidden: int = 32) -> dict:
  return {"w": jnp.asarray(np.random.default_rng(7).normal(0, 0.1, (inputs, hidden)),
                           jnp.float32),
          "v": jnp.zeros((hidden, 1))}


def regression_stream(worker: int, inputs: int = 64, batch: int = 8):
  """Worker ``worker``'s endless batches (x, y) of ``regression_loss``."""
  rng = np.random.default_rng(worker)
  while True:
    x = rng.normal(0.0, 1.0, (batch, inputs)).astype(np.float32)
    yield x, x[:, :1] - 0.5 * x[:, 1:2]
