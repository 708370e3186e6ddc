"""A run's directory: config.json, metrics.jsonl, checkpoints/ and summary.json.

docs/DESIGN.md, "Files a run writes". ``RunDirectory`` is what makes a run
resumable, for the CLI and for ``hj.simulate(workdir=...)`` alike:

  * a finished run (``summary.json``) is refused, and so is a config that
    differs from the one the checkpoints were written with (unless allowed);
  * every row goes to ``metrics.jsonl`` as it is emitted; a checkpoint is
    written every ``checkpoint_every`` outer updates, after the rows it has
    seen are on disk;
  * a re-run restores the newest readable checkpoint (falling back past a
    corrupt one) and cuts ``metrics.jsonl`` back to the rows it had seen, so
    the file ends with neither duplicates nor gaps;
  * ``summary.json`` is written atomically when the run ends;
  * one process owns a workdir at a time: ``DIR/lock`` holds an exclusive
    ``flock`` and its owner's pid and host. A second process is refused in
    one line naming them; a lock its owner left behind (the process died) is
    taken over with a warning. ``metrics.jsonl`` is opened for appending
    only, so no write can land past its end and leave a hole;
  * the processes of a ``jax.distributed`` run all name the same ``DIR``:
    process 0 owns it, process i > 0 writes its copy of the rows in
    ``DIR/process_i``, and the checkpoints are one, ``DIR/checkpoints``, each
    process writing its own shards; a checkpoint records every process's
    place in its own ``metrics.jsonl``, and one refused by any process is
    refused by all (docs/DESIGN.md, "Scaling out").

Rows and the summary are standard JSON: a NaN or ±Inf float is written as
null.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import json
import math
import os
import socket
import uuid
import warnings
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping, Optional, Protocol

import jax
import numpy as np
from jax.experimental import multihost_utils

from heloco_jax.rundir import checkpoint, processes, safe_files

Row = dict[str, Any]


# What a workdir written by an earlier version resumes with (docs/DESIGN.md, "Files a run
# writes"). hj.simulate(workdir=...)'s config.json records SCHEMA_KEY (SCHEMA_VERSION) and every
# resolved value; a resume compares it with the call key by key (config_differences): a key an
# older config.json did not record is taken at ADDED's value, or else at its RunSpec field's
# default (a field is added with the default that keeps the old behaviour), so only a key whose
# recorded value differs from the call's is refused. A newer SCHEMA_KEY is refused. The CLI's
# config.json is its resolved config: an absent key is taken at configs/schema.py's default and
# a former name as its current one (schema.RENAMED).
SCHEMA_VERSION = 1
SCHEMA_KEY = "config_schema"

# Keys of the API's config.json (dotted) an earlier layout did not record, and the value
# that reproduces how such a run ran, where it is not the RunSpec field's default
# (``spec_defaults``). Add a row with every key whose absent value means something else.
ADDED: Mapping[str, Any] = MappingProxyType({
    SCHEMA_KEY: 0,  # a config.json without it: the layout before versions were recorded
})


def spec_defaults(spec: Any) -> dict[str, Any]:
  """The defaults of ``spec``'s (a ``RunSpec``'s) fields that have one, by field name."""
  out = {}
  for field in dataclasses.fields(spec):
    if field.default is not dataclasses.MISSING:
      out[field.name] = field.default
    elif field.default_factory is not dataclasses.MISSING:
      out[field.name] = field.default_factory()
  return out


def check_version(recorded: Mapping[str, Any], path: str, flag: str) -> None:
  """Refuses a ``config.json`` of a newer layout than this library's (one line)."""
  version = recorded.get(SCHEMA_KEY, ADDED[SCHEMA_KEY])
  if isinstance(version, bool) or not isinstance(version, int) or version > SCHEMA_VERSION:
    raise ValueError(f"{path} records {SCHEMA_KEY}={version!r}, a layout newer than this "
                     f"heloco_jax's ({SCHEMA_VERSION}); allowed: resume it with the version "
                     f"that wrote it (or newer), or use a new {flag}")


# What a run writes in its workdir: files (opened without following links) and directories
# (no link in them); docs/DESIGN.md, "What a workdir trusts".
RUN_FILES = ("lock", "config.json", "metrics.jsonl", "summary.json", "run_id")
RUN_DIRS = ("checkpoints", "tensorboard", "plots")
# Config keys that say where a run's processes meet, not what they compute: a resumed
# jax.distributed run may take another coordinator address (docs/DESIGN.md, "Scaling out");
# the layout's version, which a newer library reads (SCHEMA_KEY above); and the simulated
# runtime's worker_batching as it ran ("auto" resolved per backend; docs/DESIGN.md, "Worker
# batching"), recorded for the reader.
MAY_CHANGE_ON_RESUME = ("distributed.coordinator", SCHEMA_KEY, "worker_batching")


class Checkpointable(Protocol):
  """What a run directory needs of a run (``hj.make_engine``'s engine is one): the run
  directory calls these from its checkpoint hook and when it resumes, and nothing else
  (docs/DESIGN.md, "Checkpoints")."""

  version: int  # the checkpoint's step: outer updates so far

  def snapshot(self) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole run state at a loop boundary: (arrays, JSON meta)."""
    ...

  def template(self, meta: dict[str, Any]) -> dict[str, Any]:
    """The abstract arrays of a snapshot with this ``meta``."""
    ...

  def restore(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
    """Continues from a snapshot."""
    ...


class WorkdirError(ValueError):
  """The workdir cannot hold this run (finished, another config, unreadable, in use)."""


def json_safe(value: Any) -> Any:
  """``value`` with every non-finite float replaced by None (JSON has no NaN)."""
  if isinstance(value, float):
    return value if math.isfinite(value) else None
  if isinstance(value, dict):
    return {key: json_safe(v) for key, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [json_safe(v) for v in value]
  return value


def dumps(value: Any, **kwargs: Any) -> str:
  """Standard JSON of ``value``: NaN and ±Inf become null."""
  try:
    return json.dumps(value, allow_nan=False, **kwargs)
  except ValueError:
    return json.dumps(json_safe(value), allow_nan=False, **kwargs)


def _process_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


class WorkdirLock:
  """An exclusive lock on a workdir, held until ``release`` (or the process ends).

  ``fcntl.flock`` on an open descriptor of the workdir itself, so that
  deleting, replacing or linking ``DIR/lock`` cannot let a second process in;
  ``DIR/lock`` only records the owner (pid, host, start time) for the message
  a second process gets. The kernel drops the lock when its process dies, so
  a record that names an owner while the directory is not locked was left
  by a dead process: it is taken over, and ``taken_over`` says from whom. On
  file systems without ``flock`` the recorded owner decides: a live pid on
  this host keeps the workdir.

  Raises:
    WorkdirError: another process holds the lock.
  """

  def __init__(self, path: str, flag: str, workdir: str, follow_links: bool = True):
    import fcntl  # pylint: disable=g-import-not-at-top  (POSIX)
    self.path, self.workdir, self.flag = path, workdir, flag
    self._dir = None
    self._dir = safe_files.open_fd(workdir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0),
                                   follow_links=follow_links)
    previous = self._read()
    try:
      fcntl.flock(self._dir, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      self._close()
      raise WorkdirError(f"{flag}={workdir!r} is in use by {self._owner(previous)}; allowed: "
                         f"wait until that run ends (or stop it), or use another {flag}"
                         ) from None
    except OSError as error:
      if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        raise
      if (previous.get("host") == socket.gethostname()
          and _process_alive(int(previous.get("pid", -1)))
          and previous.get("pid") != os.getpid()):
        self._close()
        raise WorkdirError(f"{flag}={workdir!r} is in use by {self._owner(previous)}; "
                           f"allowed: wait until that run ends, or use another {flag}") from None
    self.taken_over = self._owner(previous) if previous else None
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "since": datetime.datetime.now().isoformat(timespec="seconds")}
    safe_files.write_atomic(path, json.dumps(record) + "\n")

  def _read(self) -> dict[str, Any]:
    try:
      fd = safe_files.open_fd(self.path, os.O_RDONLY)
    except FileNotFoundError:
      return {}
    try:
      record = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
      return {}
    finally:
      os.close(fd)
    return record if isinstance(record, dict) else {}  # informative only: no owner known

  @staticmethod
  def _owner(record: dict[str, Any]) -> str:
    if not record:
      return "another process"
    return (f"pid {record.get('pid')} on host {record.get('host')!r} "
            f"(since {record.get('since')})")

  def check(self) -> None:
    """Raises ``WorkdirError`` if the locked directory is no longer the workdir's path (it was
    moved or replaced): the run must write nothing more."""
    try:
      now = os.stat(self.workdir)
    except OSError:
      now = None
    held = os.fstat(self._dir)
    if now is None or (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
      raise WorkdirError(f"{self.flag}={self.workdir!r} was moved or replaced while this run "
                         "held it; the run stops and writes nothing more")

  def _close(self) -> None:
    if self._dir is not None:
      os.close(self._dir)  # closing the descriptor drops the flock
      self._dir = None

  def release(self) -> None:
    """Empties the owner record (a clean end) and unlocks the workdir."""
    if self._dir is None:
      return
    try:
      if os.path.lexists(self.path):
        safe_files.write_atomic(self.path, "")
    except (OSError, safe_files.LinkError):
      pass  # the record is informative only; the lock is the descriptor's
    self._close()


def _flatten(tree: dict, prefix: str = "") -> dict:
  """{"a": {"b": 1}} -> {"a.b": 1}."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def _every_process(values: Any) -> np.ndarray:
  """``values`` (equal shapes on every process) stacked over the ``jax.distributed``
  processes, in process order; ``values[None]`` in a run of one process."""
  values = np.asarray(values)
  if jax.process_count() == 1:
    return values[None]
  return np.asarray(multihost_utils.process_allgather(values))


def _run_id_of_process_0(run_id: Optional[str]) -> Optional[str]:
  """Process 0's run id on every process (a run of several processes has one id)."""
  if jax.process_count() == 1:
    return run_id
  text = np.frombuffer((run_id or "").ljust(32).encode(), np.uint8)
  return bytes(multihost_utils.broadcast_one_to_all(text)).decode().strip() or None


def config_differences(old: dict, new: dict, defaults: Optional[dict] = None,
                       renamed: Mapping[str, str] = MappingProxyType({})) -> list[str]:
  """The keys whose values differ between two configs as JSON, as 'key (old -> new)'
  (``MAY_CHANGE_ON_RESUME`` aside).

  A key ``old`` lacks whose new value is its value in ``defaults`` is no difference:
  the old run was written before the key existed and so ran with its default. A key of
  ``old`` under a former name (``renamed``: former -> current, dotted) counts as the current.
  """
  old, new = _flatten(old), _flatten(new)
  for former, current in renamed.items():
    if former in old and current not in old:
      old[current] = old.pop(former)
  defaults = _flatten(defaults or {})
  missing = object()
  def show(value):
    return "absent" if value is missing else json.dumps(value)
  def same(key):
    before = old.get(key, missing)
    if before is missing and key in defaults:
      before = defaults[key]
    return before == new.get(key, missing)
  return [f"{key} ({show(old.get(key, missing))} -> {show(new.get(key, missing))})"
          for key in sorted(set(old) | set(new))
          if not same(key) and key not in MAY_CHANGE_ON_RESUME]


class RunDirectory:
  """The files of one run in ``path``.

  Args:
    path: the workdir (created if missing); in a ``jax.distributed`` run the
      same on every process (process i > 0 writes in ``path/process_i``).
    config_json: the run's config as JSON text (written to config.json).
    checkpoint_every: > 0 writes checkpoints.
    keep_checkpoints: how many of the newest checkpoints to keep.
    allow_config_change: resume although config.json differs.
    flag: how messages name the directory ("--workdir" for the CLI,
      "workdir" for ``hj.simulate``).
    defaults_json: the config's defaults as JSON: a key added to the library
      since the run began, set to its default, does not stop a resume.
    renamed: keys renamed since (former -> current, dotted; ``config_differences``).

  Raises:
    WorkdirError: a finished run, another config, or an unwritable directory.
  """

  def __init__(self, path: str, config_json: str, checkpoint_every: int,
               keep_checkpoints: int = 3, allow_config_change: bool = False,
               flag: str = "--workdir", defaults_json: Optional[str] = None,
               renamed: Mapping[str, str] = MappingProxyType({})):
    self.process = jax.process_index()
    self.path = path if self.process == 0 else os.path.join(path, f"process_{self.process}")
    self._config_json = config_json
    self._defaults = json.loads(defaults_json) if defaults_json else None
    self._renamed = renamed
    self._flag, self._given = flag, path
    checkpoints_dir = os.path.join(path, "checkpoints")  # one for every process
    self.checkpointer: Optional[checkpoint.Checkpointer] = None
    self.lock: Optional[WorkdirLock] = None
    self._metrics = None
    self.rows_written = 0
    # Each process checks its part, then all agree before anything collective (orbax's
    # manager, the run id): one refusal stops every process (docs/FAILURES.md).
    with self._agreed("opening the workdir"):
      # nothing the run writes may go through a link, nor DIR/process_i be one
      if self.process > 0:
        safe_files.refuse_link(self.path)
      safe_files.refuse_link(checkpoints_dir)
      for name in RUN_FILES:
        safe_files.refuse_link(self._file(name))
      for name in RUN_DIRS:
        if os.path.lexists(self._file(name)):
          safe_files.refuse_links_below(self._file(name))
      if os.path.exists(self._file("summary.json")):
        raise WorkdirError(f"{flag}={path!r} already holds a finished run (summary.json); "
                           "allowed: a new directory, or one holding an unfinished run to "
                           "resume.")
      if self.process > 0:  # DIR/process_i: made here, never through a link
        os.makedirs(path, exist_ok=True)
        safe_files.make_dirs(self.path)
      else:
        os.makedirs(self.path, exist_ok=True)
      self.lock = WorkdirLock(self._file("lock"), flag, self.path,
                              follow_links=self.process == 0)
    with self._agreed("reading the checkpoints"):
      if checkpoint_every > 0 or os.path.isdir(checkpoints_dir):
        self.checkpointer = checkpoint.Checkpointer(checkpoints_dir, keep=keep_checkpoints)
      if self.checkpointer is not None and self.checkpointer.steps():
        if not os.path.exists(self._file("config.json")):
          raise WorkdirError(f"{checkpoints_dir} holds checkpoints but "
                             f"{self._file('config.json')} is missing; allowed: a workdir "
                             "written by heloco-jax")
        differences = self._differences(config_json, flag, allow_config_change)
        if differences and not allow_config_change:
          instead = (", or pass --allow_config_change to resume with the new values"
                     if flag == "--workdir" else "")
          raise WorkdirError(
              f"{flag}={path!r} holds a run with another config; differing keys: "
              f"{', '.join(differences)}. Use a new {flag}{instead}.")
      # config.json is replaced only once a resume has succeeded (``restore``): a
      # failed --allow_config_change leaves the workdir's own config in place.
    with self._agreed("agreeing on the run id"):
      self.run_id = _run_id_of_process_0(self._run_id())

  @contextlib.contextmanager
  def _agreed(self, step: str) -> Iterator[None]:
    """Runs the block; a failure in it (on this process or, in a ``jax.distributed`` run,
    on any other) closes the workdir and raises a one-line ``WorkdirError``."""
    error: Optional[BaseException] = None
    try:
      yield
    except (OSError, checkpoint.CheckpointError, WorkdirError, safe_files.LinkError) as raised:
      if isinstance(raised, WorkdirError):
        error = raised
      elif isinstance(raised, safe_files.LinkError):
        error = WorkdirError(f"{self._flag}={self._given!r}: {raised}")
      else:
        error = WorkdirError(f"{self._flag}={self._given!r} is not writable: "
                             f"{getattr(raised, 'strerror', 0) or raised}")
    try:
      processes.agree(step, error)
    except processes.ProcessesError as other:
      error = WorkdirError(str(other))
    except WorkdirError as own:
      error = own
    if error is not None:
      self.close()
      raise error from None

  def _file(self, name: str) -> str:
    return os.path.join(self.path, name)

  def _differences(self, config_json: str, flag: str, allow_config_change: bool) -> list[str]:
    """The keys in which the workdir's config.json differs from ``config_json``."""
    path = self._file("config.json")
    instead = (", or pass --allow_config_change to resume with this command's config"
               if flag == "--workdir" else "")
    try:
      with open(path) as f:
        recorded = json.load(f)
    except json.JSONDecodeError as error:
      if allow_config_change:
        return []
      raise WorkdirError(f"{path} is not valid JSON ({error.msg}, line {error.lineno}), so "
                         f"the checkpoints' config is unknown; use a new {flag}{instead}"
                         ) from None
    if not isinstance(recorded, dict):
      if allow_config_change:
        return []
      kind = "null" if recorded is None else f"a {type(recorded).__name__}"
      raise WorkdirError(f"{path} holds {kind}, not a JSON object, so the checkpoints' config "
                         f"is unknown; use a new {flag}{instead}")
    try:
      check_version(recorded, path, flag)
    except ValueError as error:
      raise WorkdirError(str(error)) from None
    return config_differences(recorded, json.loads(config_json), self._defaults, self._renamed)

  def restore(self, run: Checkpointable) -> tuple[Optional[int], list[str]]:
    """Loads the newest readable checkpoint into ``run`` and opens metrics.jsonl.

    Returns:
      (the restored step or None, warnings to show: checkpoints skipped,
      a run started over).

    A checkpoint whose rows metrics.jsonl no longer holds (its tail was cut
    by a crash or a full disk) is passed over like an unreadable one, with a
    warning; the checkpoints after the one restored are deleted.

    Raises:
      checkpoint.CheckpointError: checkpoints exist but none can be read, or
        metrics.jsonl holds the rows of none of them.
      WorkdirError: metrics.jsonl is not a file.
    """
    restored, notes = None, []
    if self.lock is not None and self.lock.taken_over:
      notes.append(f"warning: took over the lock of {self.lock.taken_over}, which ended "
                   "without releasing it")
    path = self._file("metrics.jsonl")
    if os.path.exists(path) and not os.path.isfile(path):
      raise WorkdirError(f"{path} is not a file; allowed: a file (or none), so move it away")
    if self.checkpointer is not None:
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", checkpoint.CheckpointFallbackWarning)
        restored = self.checkpointer.restore(run.template, accept=self._covered)
      notes += [f"warning: {warning.message}" for warning in caught]
    rows_before = os.path.exists(path) and os.path.getsize(path) > 0
    if restored is not None:
      run.restore(restored[1], restored[2])
      newer = [step for step in self.checkpointer.steps() if step > restored[0]]
      if newer:
        rows = self._position(restored[2])[1]
        with open(path, "rb") as f:
          dropped = max(0, f.read().count(b"\n") - rows)
        notes.append(f"warning: resuming from checkpoint {restored[0]} drops checkpoint"
                     f"{'s' if len(newer) > 1 else ''} {', '.join(map(str, newer))} and the "
                     f"{dropped} rows of metrics.jsonl after its row {rows}")
        self.checkpointer.drop_after(restored[0])  # an abandoned timeline never resumes
    self._open_metrics(restored and restored[2])
    safe_files.write_atomic(self._file("config.json"), self._config_json)
    if restored is None:
      if rows_before:
        notes.append(f"no checkpoint in {self.path}: starting the run over")
      return None, notes
    return restored[0], notes

  def _run_id(self) -> Optional[str]:
    """The id of the workdir's run (``DIR/run_id``), made with its first start; None for a
    workdir with checkpoints from before run ids were kept."""
    path = self._file("run_id")
    if os.path.exists(path):
      with open(path) as f:
        return f.read().strip() or None
    if self.checkpointer is not None and self.checkpointer.steps():
      return None  # an older workdir: its checkpoints carry no id either
    run_id = uuid.uuid4().hex
    safe_files.write_atomic(path, run_id + "\n")
    return run_id

  def _covered(self, meta: dict) -> Optional[str]:
    """Why the run cannot continue from a checkpoint with ``meta`` (None: it can): another
    run's checkpoint, or one whose rows some process's metrics.jsonl no longer holds."""
    reason = self._covered_here(meta)
    refused = _every_process(reason is not None)
    if reason is None and refused.any():  # every process resumes from the same checkpoint
      reason = f"process {int(np.argmax(refused))} cannot resume from it"
    return reason

  def _covered_here(self, meta: dict) -> Optional[str]:
    if meta.get("run_id") != self.run_id:
      return (f"it belongs to another run (run id {meta.get('run_id')}, this workdir's "
              f"{self.run_id}): checkpoints copied from another workdir are not resumed")
    path = self._file("metrics.jsonl")
    size, rows = self._position(meta)
    if not os.path.isfile(path) or os.path.getsize(path) < size:
      have = os.path.getsize(path) if os.path.isfile(path) else 0
      return (f"metrics.jsonl holds {have} bytes, fewer than the {size} bytes ({rows} rows) "
              "it recorded")
    with open(path, "rb") as f:
      if f.read(size).count(b"\n") != rows:
        return f"metrics.jsonl's first {size} bytes do not hold the {rows} rows it recorded"
    return None

  def _position(self, meta: Optional[dict]) -> tuple[int, int]:
    """(bytes, rows) of this process's metrics.jsonl when the checkpoint ``meta`` was saved."""
    if meta is None:
      return 0, 0
    metrics = meta["metrics"]
    if "processes" in metrics:
      size, rows = metrics["processes"][self.process]
      return size, rows
    return metrics["bytes"], metrics["rows"]

  def _open_metrics(self, meta: Optional[dict]) -> None:
    """metrics.jsonl for appending: emptied for a new run, cut back to the checkpoint's rows."""
    path = self._file("metrics.jsonl")
    size, rows = self._position(meta)
    safe_files.truncate(path, size)  # created if missing; cut back to what the checkpoint saw
    # Append-only: every write lands at the end of the file, wherever it is.
    self._metrics, self.rows_written = safe_files.open_append(path), rows

  def rows_so_far(self) -> list[Row]:
    """The rows metrics.jsonl holds (after ``restore``: those of the run's earlier parts)."""
    path, rows = self._file("metrics.jsonl"), []
    with open(path) as f:
      for number, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          row = json.loads(line)
        except ValueError as error:  # the file and line to mend (docs/DESIGN.md, metrics.jsonl)
          raise WorkdirError(f"{path}, line {number}, is not a JSON row "
                             f"({getattr(error, 'msg', error)}); allowed: the rows the run wrote: "
                             f"mend that line, or use a new {self._flag}"
                             ) from None
        if not isinstance(row, dict):
          raise WorkdirError(f"{path}, line {number}, is not a JSON row (a "
                             f"{type(row).__name__}, not an object); allowed: the rows the run "
                             f"wrote: mend that line, or use a new {self._flag}")
        rows.append(row)
    return rows

  def write_row(self, row: Row) -> None:
    """Appends ``row`` to metrics.jsonl (flushed at once); NaN and ±Inf as null."""
    self._metrics.write(dumps(row) + "\n")
    self._metrics.flush()
    self.rows_written += 1

  def save_checkpoint(self, run: Checkpointable) -> None:
    """The run's whole state, after the rows so far are on disk."""
    self.lock.check()
    os.fsync(self._metrics.fileno())
    arrays, meta = run.snapshot()
    positions = _every_process([self._metrics.tell(), self.rows_written]).tolist()
    meta["metrics"] = {"bytes": positions[0][0], "rows": positions[0][1]}
    if len(positions) > 1:  # process 0 writes the metadata: where each process's rows end
      meta["metrics"]["processes"] = positions
    meta["run_id"] = self.run_id
    self.checkpointer.save(run.version, arrays, meta)

  @property
  def on_checkpoint(self) -> Optional[Callable[[Checkpointable], None]]:
    """The run's checkpoint hook (None when checkpoints are off)."""
    return self.save_checkpoint if self.checkpointer is not None else None

  def finish(self, summary: dict[str, Any]) -> None:
    """Writes summary.json atomically: it marks a finished run, so it is never half written."""
    self._metrics.close()
    self.lock.check()
    safe_files.write_atomic(self._file("summary.json"), dumps(summary, indent=2) + "\n")

  def last_checkpoint(self) -> str:
    """What a failed run leaves behind, in words."""
    last = self.checkpointer.steps()[-1:] if self.checkpointer is not None else []
    return (f"checkpoint {last[0]} is intact: re-run the same command to resume" if last
            else "no checkpoint was written")

  def close(self) -> None:
    """Closes metrics.jsonl and the checkpointer and releases the lock; a write error already
    reported (a full disk) does not raise again here."""
    if self._metrics is not None and not self._metrics.closed:
      try:
        self._metrics.close()
      except OSError:
        pass
    if self.checkpointer is not None:
      self.checkpointer.close()
      self.checkpointer = None
    if self.lock is not None:
      self.lock.release()
      self.lock = None
