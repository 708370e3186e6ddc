"""``heloco-jax train``: any method, on simulated workers or device groups (DESIGN.md, CLI).

  heloco-jax train --workdir=DIR [--config=PATH.py] [--config.KEY=VALUE ...]
  python -m heloco_jax.cli.train --workdir=DIR ...          # the same

Without ``--config`` the quickstart (``heloco_jax/cli/configs/default.py``) runs:
HeLoCo on 5 workers at the HeLoCo authors' mixed paces, one synthetic language
each, no download. Every invalid config value fails before any work with one line
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
import difflib
import json
import os
import sys
import time
import warnings
from typing import Any, Optional, Sequence

from absl import flags
from ml_collections import config_flags

from heloco_jax.cli import configs

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
  rest = flag_values(full_argv)[1:]
  if rest:
    raise ValueError(f"unexpected argument {rest[0]!r}; allowed: flags only, each starting "
                     f"with -- (e.g. --{rest[0].lstrip('-')})")
  return workdir.value, config.value, allow.value, cache.value


def _check_once(argv: Sequence[str]) -> None:
  """A flag given twice (``--config.seed=1 --config.seed=2``) as one line (ValueError): absl
  would take the last one silently."""
  seen = set()
  for arg in argv:
    if not (arg[:1] == "-" and arg.lstrip("-")[:1].isalpha()):  # a value (-0.5), not a flag
      continue
    name = "--" + arg.lstrip("-").split("=", 1)[0]
    if name in seen:
      raise ValueError(f"{name} is given twice; allowed: once (which value did you mean?)")
    seen.add(name)


def _check_config_file(argv: Sequence[str]) -> None:
  """A ``--config=PATH`` that does not load, or whose ``get_config()`` fails or returns no
  ``ConfigDict``, as one line (ValueError) instead of a traceback."""
  paths = [arg.split("=", 1)[1] for arg in argv if arg.startswith("--config=")]
  if not paths:
    return
  path = paths[-1]
  import importlib.util  # pylint: disable=g-import-not-at-top

  import ml_collections  # pylint: disable=g-import-not-at-top
  if not os.path.isfile(path):
    raise ValueError(f"--config={path!r}: no such file; allowed: a Python file with "
                     "get_config()")
  spec = importlib.util.spec_from_file_location("heloco_user_config", path)
  if spec is None or spec.loader is None:  # importlib loads .py files only
    raise ValueError(f"--config={path!r} is not a Python file (its name does not end in .py); "
                     "allowed: a Python file with get_config()")
  try:
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  except Exception as error:  # pylint: disable=broad-except  (the user's file)
    first = (str(error).strip().splitlines() or [""])[0]
    raise ValueError(f"--config={path!r} does not load: {type(error).__name__}: "
                     f"{first}") from None
  if not callable(getattr(module, "get_config", None)):
    raise ValueError(f"--config={path!r} has no get_config(); allowed: a Python file whose "
                     "get_config() returns an ml_collections.ConfigDict")
  try:
    value = module.get_config()
  except Exception as error:  # pylint: disable=broad-except
    first = (str(error).strip().splitlines() or [""])[0]
    raise ValueError(f"--config={path!r}: get_config() raised {type(error).__name__}: "
                     f"{first}") from None
  if not isinstance(value, ml_collections.ConfigDict):
    raise ValueError(f"--config={path!r}: get_config() returned a {type(value).__name__}; "
                     "allowed: an ml_collections.ConfigDict")


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
  the device. A link in its place or among its files is refused (``LinkError``):
  JAX writes there, and must not write through a link.
  """
  import jax  # pylint: disable=g-import-not-at-top

  from heloco_jax.rundir import safe_files  # pylint: disable=g-import-not-at-top
  if not path:
    return
  if os.path.lexists(path):
    safe_files.refuse_links_below(path)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


class _TolerantStderr:
  """stderr that a reader who closed it (``heloco-jax train ... 2>&1 | head -1``) cannot
  break: the first failed write sends the rest to /dev/null, and the run goes on."""

  def __init__(self, stream):
    self._stream, self.broken = stream, False

  def write(self, text: str) -> int:
    try:
      return self._stream.write(text)
    except OSError:  # BrokenPipeError, EPIPE
      self._break()
      return len(text)

  def flush(self) -> None:
    try:
      self._stream.flush()
    except OSError:
      self._break()

  def _break(self) -> None:
    if not self.broken:
      self.broken = True
      try:  # later writes by anyone (tqdm, warnings, the interpreter at exit) go nowhere
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)
      except (OSError, ValueError, AttributeError):
        pass
      self._stream = open(os.devnull, "w")  # pylint: disable=consider-using-with

  def isatty(self) -> bool:
    try:
      return self._stream.isatty()
    except (OSError, ValueError):
      return False

  def __getattr__(self, name: str):
    return getattr(self._stream, name)


def _unknown_key(argv: list[str], error: BaseException) -> str:
  """Which ``--config.KEY`` the config lacks, in one line (the new name of a renamed key)."""
  from heloco_jax.cli.configs import default, schema  # pylint: disable=g-import-not-at-top
  config = default.get_config()
  for arg in argv:
    flag = arg.split("=")[0]
    key = flag.removeprefix("--config.")
    if key == flag:
      continue
    node: Any = config
    for part in key.split("."):
      node = node.get(part) if hasattr(node, "get") else None
    if node is None and key not in schema.BY_NAME:  # (a placeholder's default is None)
      if key in schema.RENAMED:
        return f"{flag} was renamed: --config.{schema.RENAMED[key]}"
      near = difflib.get_close_matches(key, schema.BY_NAME, n=3, cutoff=0.8)
      group = sorted(k for k in schema.BY_NAME if k.split(".")[0] == key.split(".")[0]
                     and "." in k)
      hint = (f"; did you mean {', '.join('--config.' + k for k in near)}?" if near
              else f"; its group's keys: {', '.join(group)}" if group
              else "")
      return f"{flag} names no config key{hint} (every key: heloco-jax train --help)"
  return f"{str(error).splitlines()[0]} names no config key (a config file's override?)"


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


def _replay_off_by_default(config: Any, simulated: bool) -> bool:
  """Whether the unset ``deterministic`` left XLA's deterministic ops off on a simulated run
  on a GPU (``harness.deterministic``: bfloat16), where replay is then not bit for bit."""
  import jax  # pylint: disable=g-import-not-at-top
  from heloco_jax.lm import harness  # pylint: disable=g-import-not-at-top
  return (config.deterministic is None and simulated and not harness.deterministic(config)
          and jax.default_backend() == "gpu")


def main(argv: Optional[Sequence[str]] = None) -> int:
  stderr = sys.stderr
  sys.stderr = _TolerantStderr(stderr)
  try:
    return _main(list(sys.argv[1:] if argv is None else argv))
  finally:
    sys.stderr = stderr


def _stop_for_a_silent_peer(message: str) -> None:
  """Ends this process at once, in one line, when another process of its run died: its
  collectives would wait for the dead one until JAX aborts (FAILURES.md)."""
  try:
    print(f"heloco-jax train: {message}; the same command on every process resumes the run "
          "from its last checkpoint", file=sys.stderr, flush=True)
  finally:
    os._exit(3)  # pylint: disable=protected-access  (the main thread is stuck in a collective)


def _flat(tree: Any, prefix: str = "") -> dict:
  """{"a": {"b": 1}} -> {"config.a.b": 1}."""
  if not isinstance(tree, dict):
    return {prefix: tree}
  return {k: v for key, value in tree.items() for k, v in _flat(value, f"{prefix}.{key}").items()}


def _check_same_command(config: Any, workdir: str, allow_config_change: bool) -> None:
  """Refuses, on every process, a ``jax.distributed`` run whose processes share a
  ``process_id``, name another ``--workdir`` (their checkpoints are one collective write: it
  would wait forever), another ``--allow_config_change``, or resolved other configs (all keys
  but ``distributed.process_id`` and the coordinator), naming the keys that differ."""
  import jax  # pylint: disable=g-import-not-at-top

  from heloco_jax.rundir import processes  # pylint: disable=g-import-not-at-top
  if jax.process_count() == 1:
    return
  ids = processes.exchange("process ids", str(config.distributed.process_id))
  if len(set(ids)) < len(ids):
    raise processes.ProcessesError(
        f"config.distributed.process_id: the processes gave {', '.join(ids)}; allowed: "
        f"each of 0 … {len(ids) - 1} once")
  shared = config.copy_and_resolve_references()
  with shared.unlocked():
    shared.distributed.process_id = 0
    shared.distributed.coordinator = ""
  mine = {"--workdir": os.path.abspath(workdir), "--allow_config_change": allow_config_change,
          "config": json.loads(shared.to_json_best_effort(sort_keys=True))}
  commands = [json.loads(value) for value in processes.exchange(
      "commands", json.dumps(mine, sort_keys=True))]
  first = commands[0]
  for i, command in enumerate(commands[1:], 1):
    for flag in ("--workdir", "--allow_config_change"):
      if command[flag] != first[flag]:
        raise processes.ProcessesError(
            f"{flag} differs: process {i} gave {command[flag]!r}, process 0 {first[flag]!r}; "
            f"allowed: the same {flag} on every process (process i > 0 writes DIR/process_i)")
    theirs, ours = _flat(command["config"], "config"), _flat(first["config"], "config")
    keys = sorted(key for key in {*theirs, *ours} if theirs.get(key, "absent") != ours.get(
        key, "absent"))
    if keys:
      named = ", ".join(f"{key} ({ours.get(key, 'absent')!r} on process 0, "
                        f"{theirs.get(key, 'absent')!r} on process {i})" for key in keys[:4])
      raise processes.ProcessesError(
          f"the processes' resolved configs differ: process {i} against process 0: {named}"
          f"{f' and {len(keys) - 4} more' if len(keys) > 4 else ''}; allowed: the same command "
          "on every process but config.distributed.process_id")


def _main(argv: list[str]) -> int:
  if any(arg in ("-h", "--help", "--helpfull", "help") for arg in argv):
    from heloco_jax.cli.configs import default  # pylint: disable=g-import-not-at-top
    from heloco_jax.cli.configs import help as config_help
    print(f"{USAGE}\n\n{__doc__.strip()}\n\nconfig keys (--config.KEY=VALUE):\n"
          f"{config_help.describe(default.get_config())}")
    return 0
  try:
    _check_once(argv)
    _check_config_file(argv)
  except ValueError as error:
    return _error(str(error))
  try:
    workdir, config, allow_config_change, compilation_cache = _parse(argv)
  except (KeyError, AttributeError) as error:  # an override of a key the config lacks
    return _error(f"{_unknown_key(argv, error)}\n{USAGE}")
  except (flags.Error, TypeError, ValueError) as error:
    return _error(f"{str(error).splitlines()[0]}\n{USAGE}")
  if not workdir:
    return _error(f"--workdir is required; {USAGE}")

  # Validation before any work (and before importing JAX-heavy modules).
  from heloco_jax.cli.configs import validation  # pylint: disable=g-import-not-at-top
  from heloco_jax.lm import harness  # pylint: disable=g-import-not-at-top
  from heloco_jax.rundir import checkpoint  # pylint: disable=g-import-not-at-top
  from heloco_jax.rundir import processes  # pylint: disable=g-import-not-at-top
  from heloco_jax.rundir import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  from heloco_jax.runtime import devices  # pylint: disable=g-import-not-at-top
  from heloco_jax.runtime import engine as engine_lib  # pylint: disable=g-import-not-at-top
  from heloco_jax.training import determinism, rejection  # pylint: disable=g-import-not-at-top
  try:
    validation.validate_distributed(config)  # before JAX starts
    determinism.configure(validation.deterministic(config))  # the CLI owns its process
    devices.initialize_distributed(config.distributed.coordinator,
                                   config.distributed.num_processes,
                                   config.distributed.process_id,
                                   config.distributed.timeout)
    validation.validate(config)
  except (validation.ConfigError, determinism.DeterminismError) as error:
    return _error(str(error))
  except processes.ProcessesError as error:  # a peer did not arrive (FAILURES.md)
    return _error(str(error))
  except RuntimeError as error:  # jax.distributed could not reach the coordinator
    return _error(f"config.distributed.coordinator={config.distributed.coordinator!r}: "
                  f"{str(error).splitlines()[0]}")
  try:
    use_compilation_cache(default_cache_dir() if compilation_cache is None
                          else compilation_cache)
  except ValueError as error:  # safe_files.LinkError
    return _error(f"--compilation_cache: {error}")
  # config.json: the resolved config and the layout's version (docs/DESIGN.md, "Files a run
  # writes"; rundir/workdir.py, SCHEMA_KEY), as the API's
  recorded = json.loads(config.to_json_best_effort(sort_keys=True))
  recorded[workdir_lib.SCHEMA_KEY] = workdir_lib.SCHEMA_VERSION
  config_json = json.dumps(recorded, indent=2, sort_keys=True) + "\n"
  try:  # the processes of a jax.distributed run: one command but process_id (FAILURES.md)
    _check_same_command(config, workdir, allow_config_change)
  except RuntimeError as error:  # processes.ProcessesError
    return _error(str(error))
  processes.watch_peers(_stop_for_a_silent_peer)
  from heloco_jax import api  # pylint: disable=g-import-not-at-top
  from heloco_jax.cli.configs import default, schema  # pylint: disable=g-import-not-at-top
  directory = api.Workdir(workdir, checkpoint_every=config.checkpoint.every,
                          keep_checkpoints=config.checkpoint.keep,
                          allow_config_change=allow_config_change, config_json=config_json,
                          flag="--workdir",
                          defaults_json=default.get_config().to_json_best_effort(),
                          renamed=schema.RENAMED)
  try:  # the data first: a config it refuses leaves no trace in the workdir
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      engine, problem = harness.engine_of_config(config, workdir=directory)
  except (workdir_lib.WorkdirError, checkpoint.CheckpointError) as error:
    return _error(str(error))
  except ConnectionError as error:  # e.g. runtime=ray with an unreachable ray.address
    return _error(f"config.runtime={config.runtime!r}: cannot connect: "
                  f"{(str(error).strip().splitlines() or [type(error).__name__])[0]}")
  except OSError as error:
    return _error(f"cannot resume: {error.strerror or error}")
  except ValueError as error:  # e.g. a corpus too small for the validation set
    return _error(str(error).splitlines()[0])
  workdir = engine.directory.path  # process i > 0 of a jax.distributed run: DIR/process_i
  for note in engine.workdir_notes:
    print(f"heloco-jax train: {note}", file=sys.stderr)
  if _replay_off_by_default(config, engine.clock.simulated):
    print("heloco-jax train: note: no bit-exact replay on this GPU: model.compute_dtype="
          "bfloat16 runs without XLA's deterministic ops by default (2.5x slower with them; "
          "docs/DESIGN.md, 'Determinism'); --config.deterministic=true turns them on",
          file=sys.stderr)
  for warning in caught:  # anything else a library warned about while building
    if not str(warning.message).startswith("--workdir="):
      warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
  seconds = "simulated s" if engine.clock.simulated else "real s"
  if engine.resumed_from is not None:
    print(f"heloco-jax train: resuming from checkpoint {engine.resumed_from} ({engine.units} "
          f"tokens, {engine.sim_time:.0f} {seconds})", file=sys.stderr)
  where = engine.runtime.describe()
  if engine.clock.simulated:
    where += f" ({config.speeds if isinstance(config.speeds, str) else 'custom'} speeds)"
  print(f"heloco-jax train: {config.method} on {config.num_workers} {where}, "
        f"{engine.num_params / 1e6:.2f}M parameters, data {config.data.source}/"
        f"{config.data.partition} ({', '.join(problem.data.languages)}); writing {workdir}",
        file=sys.stderr)
  from heloco_jax.rundir import writers  # pylint: disable=g-import-not-at-top
  extra = writers.for_workdir(writers.parse(config.writers), workdir, engine.rows)
  bar = None if config.quiet else _progress(config.budget.tokens)
  lines = (ProgressLines(config.budget.tokens, config.budget.sim_seconds)
           if bar is None and not config.quiet else None)
  last_loss = float("nan")

  def on_row(row):
    nonlocal last_loss
    if extra is not None:
      extra(row)
    if row["event"] == "eval":
      last_loss = row["val_loss"]
    if lines is not None:
      lines.update(engine.units, engine.sim_time, last_loss, row["event"] == "eval")
    if bar is not None:
      bar.n = engine.units
      bar.set_postfix(sim_time=f"{engine.sim_time:.0f}s", val_loss=f"{last_loss:.3f}",
                      refresh=False)
      bar.refresh()

  try:
    with engine_lib.stop_on_signals(engine):
      summary = asyncio.run(engine.run(on_row))
  except engine_lib.BudgetError as error:
    return _error(str(error))
  except (OSError, checkpoint.CheckpointError, KeyboardInterrupt, engine_lib.Stopped,
          rejection.DivergenceError, workdir_lib.WorkdirError, RuntimeError) as error:
    keep = engine.directory.last_checkpoint()
    if isinstance(error, engine_lib.Stopped) and error.reason == "SIGTERM":
      print(f"heloco-jax train: stopped by SIGTERM (preemption) at the end of an arrival; "
            f"{keep}", file=sys.stderr)
      return 143
    if isinstance(error, (KeyboardInterrupt, engine_lib.Stopped)):
      print(f"heloco-jax train: interrupted; {keep}", file=sys.stderr)
      return 130
    if isinstance(error, (checkpoint.CheckpointError, workdir_lib.WorkdirError)):
      message = str(error)
    elif isinstance(error, (rejection.DivergenceError, RuntimeError)):
      message = f"the run stopped: {error}; {keep}"
    else:
      message = f"cannot write to --workdir={workdir!r}: {error.strerror or error}; {keep}"
    print(f"heloco-jax train: {message}", file=sys.stderr, flush=True)
    if isinstance(error, RuntimeError) and getattr(engine.runtime.executor, "process_count",
                                                   1) > 1:
      # A collective failed: a peer is gone. JAX's exit would wait for it at its shutdown
      # barrier and abort 100 s later (FAILURES.md, "Several processes"); the checkpoint is
      # whole, so this process ends here.
      os._exit(1)  # pylint: disable=protected-access
    return 1
  finally:
    processes.finished()  # the other processes' watchers: this one ended on purpose
    if bar is not None:
      bar.close()
    try:  # a full disk or EPERM already reported above must not raise a second time here
      if extra is not None:
        extra.close()
    except OSError:
      pass
    engine.close()
  count = summary["rejected"]  # per reason: the rejected rows' (DESIGN.md, "summary.json")
  reasons = ", ".join(f"{reason} {n}" for reason, n in summary["rejected_by"].items())
  rejected = (f" ({summary['rejected_tokens']} of them rejected: {count} "
              f"pseudo-gradient{'s' * (count != 1)}: {reasons})" if count else "")
  stopped = f"stopped: {summary['stopped']}: " if summary.get("stopped") else ""
  print(f"heloco-jax train: {stopped or 'done: '}{summary['tokens']} tokens{rejected}, "
        f"{summary['outer_updates']} outer updates, {summary['sim_time']:.0f} {seconds}, "
        f"{summary['bytes_sent'] / 1e6:,.1f} MB sent, val_loss "
        f"{_loss(summary['initial_val_loss'])} -> {_loss(summary['final_val_loss'])} "
        f"({summary['wall_seconds']:.0f} s, {summary['tokens_per_second']:.0f} tokens/s)",
        file=sys.stderr)
  return 0


def _loss(value: Any) -> str:
  """A summary's loss for the last line: null (an evaluation that failed) as 'none'."""
  return "none" if value is None else f"{value:.3f}"


if __name__ == "__main__":
  sys.exit(main())
