"""``heloco-jax train``: train with any method on simulated workers (DESIGN.md, "Command line").

  heloco-jax train --workdir=DIR [--config=PATH.py] [--config.KEY=VALUE ...]
  python -m heloco_jax.train --workdir=DIR ...          # the same

Without ``--config`` the quickstart (``heloco_jax/configs/default.py``) runs:
HeLoCo on 5 workers of severe heterogeneity, one synthetic language each, no
download. Every invalid config value fails before any work with one line
naming the key, the value and what is allowed (exit status 2).

Writes ``DIR/config.json`` (the resolved config), ``DIR/metrics.jsonl`` (eval
and arrival rows, written as they happen) and ``DIR/summary.json``. A progress
bar (tokens, simulated time, last validation loss) shows on a terminal.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Optional, Sequence

from absl import flags
from ml_collections import config_flags

from heloco_jax import configs

_DEFAULT_CONFIG = os.path.join(os.path.dirname(configs.__file__), "default.py")
USAGE = ("usage: heloco-jax train --workdir=DIR [--config=PATH.py] [--config.KEY=VALUE ...]")


def _parse(argv: list[str]):
  """(workdir, config) from the command line; flags are defined per call on our own argv."""
  flag_values = flags.FlagValues()
  full_argv = ["heloco-jax train", *argv]
  workdir = flags.DEFINE_string("workdir", None, "Directory for the run's outputs.",
                                flag_values=flag_values)
  config = config_flags.DEFINE_config_file(
      "config", _DEFAULT_CONFIG, "A Python config file with get_config() (default: the "
      "quickstart).", flag_values=flag_values, lock_config=True, sys_argv=full_argv)
  flag_values(full_argv)
  return workdir.value, config.value


def _error(message: str) -> int:
  print(f"heloco-jax train: {message}", file=sys.stderr)
  return 2


def _progress(total_tokens: int):
  """A tqdm bar on a terminal; None when stderr is not a TTY."""
  if not sys.stderr.isatty():
    return None
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top
  return tqdm(total=total_tokens or None, unit="tok", unit_scale=True, dynamic_ncols=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  try:
    workdir, config = _parse(argv)
  except (KeyError, AttributeError) as error:  # an override of a key the config lacks
    key = str(error).strip("\"'").split("'")[0]
    flag = next((arg.split("=")[0] for arg in argv if f".{key}" in arg), key)
    return _error(f"{flag} names no config key (the keys: heloco_jax/configs/default.py)\n"
                  f"{USAGE}")
  except (flags.Error, TypeError, ValueError) as error:
    return _error(f"{str(error).splitlines()[0]}\n{USAGE}")
  if not workdir:
    return _error(f"--workdir is required; {USAGE}")

  # Validation before any work (and before importing JAX-heavy modules).
  from heloco_jax import scheduler  # pylint: disable=g-import-not-at-top
  from heloco_jax.configs import validation  # pylint: disable=g-import-not-at-top
  try:
    validation.validate(config)
  except validation.ConfigError as error:
    return _error(str(error))
  if os.path.exists(os.path.join(workdir, "summary.json")):
    return _error(f"--workdir={workdir!r} already holds a finished run (summary.json); "
                  "allowed: a new or empty directory (resuming arrives with checkpoints).")
  try:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2, sort_keys=True) + "\n")
  except OSError as error:
    return _error(f"--workdir={workdir!r} is not writable: {error.strerror}")

  try:
    simulation = scheduler.Simulation(config)
  except ValueError as error:  # e.g. a corpus too small for the validation set
    return _error(str(error).splitlines()[0])
  print(f"heloco-jax train: {config.method} on {config.num_workers} simulated workers "
        f"({config.speeds if isinstance(config.speeds, str) else 'custom'} speeds), "
        f"{simulation.num_params / 1e6:.2f}M parameters, data {config.data.source}/"
        f"{config.data.partition} ({', '.join(simulation.data.languages)}); writing {workdir}",
        file=sys.stderr)
  bar = _progress(config.budget.tokens)
  last_loss = float("nan")
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as metrics:
    def on_row(row):
      nonlocal last_loss
      metrics.write(json.dumps(row) + "\n")
      metrics.flush()
      if row["event"] == "eval":
        last_loss = row["val_loss"]
      if bar is not None:
        bar.n = simulation.tokens
        bar.set_postfix(sim_time=f"{simulation.sim_time:.0f}s", val_loss=f"{last_loss:.3f}",
                        refresh=False)
        bar.refresh()
    summary = asyncio.run(simulation.run(on_row))
  if bar is not None:
    bar.close()
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
    f.write("\n")
  print(f"heloco-jax train: done: {summary['tokens']} tokens, {summary['outer_updates']} outer "
        f"updates, {summary['sim_time']:.0f} simulated s, val_loss "
        f"{summary['initial_val_loss']:.3f} -> {summary['final_val_loss']:.3f} "
        f"({summary['wall_seconds']:.0f} s, {summary['tokens_per_second']:.0f} tokens/s)",
        file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
