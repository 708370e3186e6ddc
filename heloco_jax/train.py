"""``heloco-jax train``: any method, on simulated workers or device groups (DESIGN.md, CLI).

  heloco-jax train --workdir=DIR [--config=PATH.py] [--config.KEY=VALUE ...]
  python -m heloco_jax.train --workdir=DIR ...          # the same

Without ``--config`` the quickstart (``heloco_jax/configs/default.py``) runs:
HeLoCo on 5 workers of severe heterogeneity, one synthetic language each, no
download. Every invalid config value fails before any work with one line
naming the key, the value and what is allowed (exit status 2).

Writes ``DIR/config.json`` (the resolved config), ``DIR/metrics.jsonl`` (eval,
arrival and rejected rows, written as they happen), ``DIR/checkpoints/`` (every
``checkpoint_every`` outer updates; the newest ``keep_checkpoints``) and
``DIR/summary.json``; with tensorboardX installed also TensorBoard event files
in ``DIR/tensorboard`` (``--config.writers``). A progress bar (tokens, simulated time, last validation
loss) shows on a terminal; elsewhere (a batch job, nohup, CI, a notebook) a
progress line every 30 s and at every evaluation (tokens, simulated time, last
validation loss, tokens/s, time left). ``--config.quiet=true`` shows neither.

Resume: the same command with the same ``--workdir`` continues from the
newest readable checkpoint (falling back past a corrupt one, with a
warning). ``metrics.jsonl`` is cut back to the rows the checkpoint had seen,
so it ends with neither duplicates nor gaps, and the summary equals an
uninterrupted run's (``wall_seconds`` adds up the parts). A config that
differs from the workdir's ``config.json`` is refused, naming the keys,
unless ``--allow_config_change`` is given.

Preemption: SIGTERM (how Cloud TPU and spot VMs announce it) or a first
Ctrl-C lets the arrival in progress finish, writes a checkpoint and exits; the
same command resumes exactly. A second Ctrl-C stops at once (the last
periodic checkpoint holds the run).

One process owns a workdir at a time (``DIR/lock``): a second one exits at
once naming the owner's pid and host; a lock left by a process that died is
taken over with a warning.

Exit status: 0 done, 1 a write or checkpoint failure or a diverged run (the
last good checkpoint is kept), 2 a usage or config error (a budget that holds
no dispatch and a workdir in use included), 130 interrupted (Ctrl-C), 143
stopped by SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from typing import Optional, Sequence

from absl import flags
from ml_collections import config_flags

from heloco_jax import configs

_DEFAULT_CONFIG = os.path.join(os.path.dirname(configs.__file__), "default.py")
USAGE = ("usage: heloco-jax train --workdir=DIR [--config=PATH.py] [--config.KEY=VALUE ...] "
         "[--allow_config_change] [--compilation_cache=DIR]")


def _parse(argv: list[str]):
  """(workdir, config) from the command line; flags are defined per call on our own argv."""
  flag_values = flags.FlagValues()
  full_argv = ["heloco-jax train", *argv]
  workdir = flags.DEFINE_string("workdir", None, "Directory for the run's outputs.",
                                flag_values=flag_values)
  config = config_flags.DEFINE_config_file(
      "config", _DEFAULT_CONFIG, "A Python config file with get_config() (default: the "
      "quickstart).", flag_values=flag_values, lock_config=True, sys_argv=full_argv)
  allow = flags.DEFINE_bool(
      "allow_config_change", False, "Resume a workdir's run even though its config.json "
      "differs from this config.", flag_values=flag_values)
  cache = flags.DEFINE_string(
      "compilation_cache", None, "JAX's persistent compilation cache directory; '' turns it "
      f"off (default: $JAX_COMPILATION_CACHE_DIR, else {default_cache_dir()}).",
      flag_values=flag_values)
  flag_values(full_argv)
  return workdir.value, config.value, allow.value, cache.value


def default_cache_dir() -> str:
  """$JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME (~/.cache)/heloco_jax/xla."""
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return os.environ["JAX_COMPILATION_CACHE_DIR"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "heloco_jax", "xla")


def use_compilation_cache(path: str) -> None:
  """Keeps compiled programs in ``path`` ("" = off), so that later runs skip compiling.

  JAX's persistent compilation cache: every program is stored (also the small
  ones, which add up to seconds), keyed by the program, the JAX version and
  the device.
  """
  import jax  # pylint: disable=g-import-not-at-top
  if not path:
    return
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _error(message: str) -> int:
  print(f"heloco-jax train: {message}", file=sys.stderr)
  return 2


def _progress(total_tokens: int):
  """A tqdm bar on a terminal; None when stderr is not a TTY."""
  if not sys.stderr.isatty():
    return None
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top
  return tqdm(total=total_tokens or None, unit="tok", unit_scale=True, dynamic_ncols=True)


class ProgressLines:
  """Progress for a stderr that is not a terminal (a batch job, nohup, CI, a notebook): one
  line at most every ``interval`` seconds and one at every evaluation.

  Rows come in bursts (``metrics_fetch_every``), so a line that is due at an arrival waits for
  the next row: when that row is an evaluation of the same burst, the evaluation's line
  (with the new loss) is the only one.

  Attributes:
    total_tokens: the token budget (0: none).
    total_seconds: the time budget in the run's seconds (0: none).
  """

  def __init__(self, total_tokens: int, total_seconds: float, interval: float = 30.0,
               clock=time.monotonic, stream=None):
    self.total_tokens, self.total_seconds, self.interval = total_tokens, total_seconds, interval
    self._clock, self._stream = clock, stream
    self._start = self._last = clock()
    self._start_done: Optional[float] = None  # a resumed run's ETA counts this process only
    self._due: Optional[tuple] = None  # a line due at an arrival, printed at the next row

  def _done(self, tokens: int, seconds: float) -> Optional[float]:
    """The fraction of the budget done (the larger of tokens and time), None without one."""
    fractions = ([tokens / self.total_tokens] if self.total_tokens else []) + (
        [seconds / self.total_seconds] if self.total_seconds else [])
    return min(1.0, max(fractions)) if fractions else None

  def update(self, tokens: int, seconds: float, val_loss: float, evaluated: bool) -> None:
    now = self._clock()
    if self._start_done is None:
      self._start_done, self._start_tokens = self._done(tokens, seconds) or 0.0, tokens
    if self._due is not None and not evaluated and now - self._due[0] > 0.5:
      self._print(*self._due)  # no evaluation followed in its burst
    self._due = None
    if evaluated:
      self._print(now, tokens, seconds, val_loss)
    elif now - self._last >= self.interval:
      self._due = (now, tokens, seconds, val_loss)

  def _print(self, now: float, tokens: int, seconds: float, val_loss: float) -> None:
    self._last, done = now, self._done(tokens, seconds)
    elapsed = max(now - self._start, 1e-9)
    line = f"heloco-jax train: {tokens:,} tokens"
    line += f" of {self.total_tokens:,}" if self.total_tokens else ""
    line += f" ({100 * done:.0f}%)" if done is not None else ""
    line += (f", {seconds:.0f} s simulated, val_loss {val_loss:.3f}, "
             f"{(tokens - self._start_tokens) / elapsed:,.0f} tokens/s")
    if done is not None and self._start_done < done < 1:
      left = elapsed * (1 - done) / (done - self._start_done)
      line += f", about {left / 60:.1f} min left"
    print(line, file=self._stream or sys.stderr, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if any(arg in ("-h", "--help", "--helpfull", "help") for arg in argv):
    from heloco_jax.configs import default, help as config_help  # pylint: disable=g-import-not-at-top
    print(f"{USAGE}\n\n{__doc__.strip()}\n\nconfig keys (--config.KEY=VALUE):\n"
          f"{config_help.describe(default.get_config())}")
    return 0
  try:
    workdir, config, allow_config_change, compilation_cache = _parse(argv)
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
  from heloco_jax import checkpoint, determinism, harness, rejection  # pylint: disable=g-import-not-at-top
  from heloco_jax import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  from heloco_jax.runtime import engine  # pylint: disable=g-import-not-at-top
  from heloco_jax.runtime import devices  # pylint: disable=g-import-not-at-top
  from heloco_jax.configs import validation  # pylint: disable=g-import-not-at-top
  try:
    validation.validate_distributed(config)  # before JAX starts
    determinism.configure(validation.deterministic(config))  # the CLI owns its process
    devices.initialize_distributed(config)
    validation.validate(config)
  except (validation.ConfigError, determinism.DeterminismError) as error:
    return _error(str(error))
  except RuntimeError as error:  # jax.distributed could not reach the coordinator
    return _error(f"config.distributed.coordinator={config.distributed.coordinator!r}: "
                  f"{str(error).splitlines()[0]}")
  use_compilation_cache(default_cache_dir() if compilation_cache is None else compilation_cache)
  if config.distributed.coordinator:
    import jax  # pylint: disable=g-import-not-at-top
    if jax.process_index() > 0:  # process 0 writes the workdir
      workdir = os.path.join(workdir, f"process_{jax.process_index()}")
  seconds = "simulated s" if config.runtime == "simulated" else "real s"
  config_json = config.to_json_best_effort(indent=2, sort_keys=True) + "\n"
  try:  # the data first: a config it refuses leaves no trace in the workdir
    simulation = harness.Simulation(config)
  except ValueError as error:  # e.g. a corpus too small for the validation set
    return _error(str(error).splitlines()[0])
  try:
    directory = workdir_lib.RunDirectory(workdir, config_json, config.checkpoint_every,
                                         config.keep_checkpoints, allow_config_change)
  except workdir_lib.WorkdirError as error:
    simulation.close()
    return _error(str(error))
  try:
    step, notes = directory.restore(simulation)
  except (checkpoint.CheckpointError, workdir_lib.WorkdirError, OSError) as error:
    directory.close()
    simulation.close()
    if isinstance(error, OSError):
      return _error(f"cannot resume: {error.strerror or error}")
    return _error(str(error))
  for note in notes:
    print(f"heloco-jax train: {note}", file=sys.stderr)
  if step is not None:
    print(f"heloco-jax train: resuming from checkpoint {step} ({simulation.units} "
          f"tokens, {simulation.sim_time:.0f} {seconds})", file=sys.stderr)
  where = simulation.runtime.describe()
  if config.runtime == "simulated":
    where += f" ({config.speeds if isinstance(config.speeds, str) else 'custom'} speeds)"
  print(f"heloco-jax train: {config.method} on {config.num_workers} {where}, "
        f"{simulation.num_params / 1e6:.2f}M parameters, data {config.data.source}/"
        f"{config.data.partition} ({', '.join(simulation.data.languages)}); writing {workdir}",
        file=sys.stderr)
  from heloco_jax import writers  # pylint: disable=g-import-not-at-top
  extra = writers.for_workdir(writers.parse(config.writers), workdir)
  bar = None if config.quiet else _progress(config.budget.tokens)
  lines = (ProgressLines(config.budget.tokens, config.budget.sim_seconds)
           if bar is None and not config.quiet else None)
  last_loss = float("nan")

  def on_row(row):
    nonlocal last_loss
    directory.write_row(row)
    if extra is not None:
      extra(row)
    if row["event"] == "eval":
      last_loss = row["val_loss"]
    if lines is not None:
      lines.update(simulation.units, simulation.sim_time, last_loss, row["event"] == "eval")
    if bar is not None:
      bar.n = simulation.units
      bar.set_postfix(sim_time=f"{simulation.sim_time:.0f}s", val_loss=f"{last_loss:.3f}",
                      refresh=False)
      bar.refresh()

  def stop_at_the_next_boundary(signum, frame):
    del frame
    if simulation.stop_requested and signum == signal.SIGINT:
      raise KeyboardInterrupt  # a second Ctrl-C: at once, from the last checkpoint
    simulation.request_stop(signal.Signals(signum).name)
  handlers = {}
  if threading.current_thread() is threading.main_thread():  # where Python runs handlers
    handlers = {signum: signal.signal(signum, stop_at_the_next_boundary)
                for signum in (signal.SIGTERM, signal.SIGINT)}
  try:
    summary = asyncio.run(simulation.run(on_row, directory.on_checkpoint))
    directory.finish(summary)
  except engine.BudgetError as error:
    return _error(str(error))
  except (OSError, checkpoint.CheckpointError, KeyboardInterrupt, engine.Stopped,
          rejection.DivergenceError) as error:
    keep = directory.last_checkpoint()
    if isinstance(error, engine.Stopped) and error.reason == "SIGTERM":
      print(f"heloco-jax train: stopped by SIGTERM (preemption) at the end of an arrival; "
            f"{keep}", file=sys.stderr)
      return 143
    if isinstance(error, (KeyboardInterrupt, engine.Stopped)):
      print(f"heloco-jax train: interrupted; {keep}", file=sys.stderr)
      return 130
    if isinstance(error, rejection.DivergenceError):
      message = f"the run stopped: {error}; {keep}"
    elif isinstance(error, checkpoint.CheckpointError):
      message = str(error)
    else:
      message = f"cannot write to --workdir={workdir!r}: {error.strerror or error}; {keep}"
    print(f"heloco-jax train: {message}", file=sys.stderr)
    return 1
  finally:
    for signum, handler in handlers.items():
      signal.signal(signum, handler)
    if bar is not None:
      bar.close()
    if extra is not None:
      extra.close()
    directory.close()
    simulation.close()
  rejected = (f" ({summary['rejected_tokens']} of them rejected: {summary['rejected']} "
              "non-finite pseudo-gradients)" if summary["rejected"] else "")
  print(f"heloco-jax train: done: {summary['tokens']} tokens{rejected}, "
        f"{summary['outer_updates']} outer updates, {summary['sim_time']:.0f} {seconds}, val_loss "
        f"{summary['initial_val_loss']:.3f} -> {summary['final_val_loss']:.3f} "
        f"({summary['wall_seconds']:.0f} s, {summary['tokens_per_second']:.0f} tokens/s)",
        file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
