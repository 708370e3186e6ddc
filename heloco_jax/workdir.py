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
  * ``summary.json`` is written atomically when the run ends.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Callable, Optional

from heloco_jax import checkpoint

Row = dict[str, Any]


class WorkdirError(ValueError):
  """The workdir cannot hold this run (finished, another config, unreadable)."""


def _flatten(tree: dict, prefix: str = "") -> dict:
  """{"a": {"b": 1}} -> {"a.b": 1}."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def config_differences(old: dict, new: dict) -> list[str]:
  """The keys whose values differ between two configs as JSON, as 'key (old -> new)'."""
  old, new = _flatten(old), _flatten(new)
  missing = object()
  def show(value):
    return "absent" if value is missing else json.dumps(value)
  return [f"{key} ({show(old.get(key, missing))} -> {show(new.get(key, missing))})"
          for key in sorted(set(old) | set(new)) if old.get(key, missing) != new.get(key, missing)]


class RunDirectory:
  """The files of one run in ``path``.

  Args:
    path: the workdir (created if missing).
    config_json: the run's config as JSON text (written to config.json).
    checkpoint_every: > 0 writes checkpoints.
    keep_checkpoints: how many of the newest checkpoints to keep.
    allow_config_change: resume although config.json differs.
    flag: how messages name the directory ("--workdir" for the CLI,
      "workdir" for ``hj.simulate``).

  Raises:
    WorkdirError: a finished run, another config, or an unwritable directory.
  """

  def __init__(self, path: str, config_json: str, checkpoint_every: int,
               keep_checkpoints: int = 3, allow_config_change: bool = False,
               flag: str = "--workdir"):
    self.path = path
    if os.path.exists(self._file("summary.json")):
      raise WorkdirError(f"{flag}={path!r} already holds a finished run (summary.json); "
                         "allowed: a new directory, or one holding an unfinished run to resume.")
    checkpoints_dir = self._file("checkpoints")
    self.checkpointer: Optional[checkpoint.Checkpointer] = None
    try:
      os.makedirs(path, exist_ok=True)
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
      with open(self._file("config.json.new"), "w") as f:
        f.write(config_json)
    except (OSError, checkpoint.CheckpointError) as error:
      raise WorkdirError(f"{flag}={path!r} is not writable: "
                         f"{getattr(error, 'strerror', 0) or error}") from None
    self._metrics = None
    self.rows_written = 0

  def _file(self, name: str) -> str:
    return os.path.join(self.path, name)

  def _differences(self, config_json: str, flag: str, allow_config_change: bool) -> list[str]:
    """The keys in which the workdir's config.json differs from ``config_json``."""
    path = self._file("config.json")
    try:
      with open(path) as f:
        return config_differences(json.load(f), json.loads(config_json))
    except json.JSONDecodeError as error:
      if allow_config_change:
        return []
      instead = (", or pass --allow_config_change to resume with this command's config"
                 if flag == "--workdir" else "")
      raise WorkdirError(f"{path} is not valid JSON ({error.msg}, line {error.lineno}), so "
                         f"the checkpoints' config is unknown; use a new {flag}{instead}"
                         ) from None

  def restore(self, engine: Any) -> tuple[Optional[int], list[str]]:
    """Loads the newest readable checkpoint into ``engine`` and opens metrics.jsonl.

    Returns:
      (the restored step or None, warnings to show: checkpoints skipped,
      a run started over).

    Raises:
      checkpoint.CheckpointError: checkpoints exist but none can be read.
      OSError: metrics.jsonl does not hold the rows the checkpoint recorded.
    """
    restored, notes = None, []
    if self.checkpointer is not None:
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", checkpoint.CheckpointFallbackWarning)
        restored = self.checkpointer.restore(engine.state_template)
      notes += [f"warning: {warning.message}" for warning in caught]
    path = self._file("metrics.jsonl")
    rows_before = os.path.exists(path) and os.path.getsize(path) > 0
    if restored is not None:
      engine.load_state(restored[1], restored[2])
    self._open_metrics(restored and restored[2])
    os.replace(self._file("config.json.new"), self._file("config.json"))
    if restored is None:
      if rows_before:
        notes.append(f"no checkpoint in {self.path}: starting the run over")
      return None, notes
    return restored[0], notes

  def _open_metrics(self, meta: Optional[dict]) -> None:
    """metrics.jsonl for appending: emptied for a new run, cut back to the checkpoint's rows."""
    path = self._file("metrics.jsonl")
    if meta is None:
      self._metrics, self.rows_written = open(path, "w"), 0
      return
    size, rows = meta["metrics"]["bytes"], meta["metrics"]["rows"]
    if not os.path.exists(path) or os.path.getsize(path) < size:
      raise OSError(f"{path} is shorter than checkpoint {meta['version']} recorded ({size} "
                    f"bytes, {rows} rows); its rows are lost")
    with open(path, "r+b") as f:
      f.truncate(size)
      f.seek(0)
      if f.read().count(b"\n") != rows:
        raise OSError(f"{path} does not hold the {rows} rows checkpoint {meta['version']} "
                      "recorded")
    self._metrics, self.rows_written = open(path, "a"), rows

  def write_row(self, row: Row) -> None:
    """Appends ``row`` to metrics.jsonl (flushed at once)."""
    self._metrics.write(json.dumps(row) + "\n")
    self._metrics.flush()
    self.rows_written += 1

  def save_checkpoint(self, engine: Any) -> None:
    """The engine's whole state, after the rows so far are on disk."""
    os.fsync(self._metrics.fileno())
    arrays, meta = engine.checkpoint_state()
    meta["metrics"] = {"bytes": self._metrics.tell(), "rows": self.rows_written}
    self.checkpointer.save(engine.version, arrays, meta)

  @property
  def on_checkpoint(self) -> Optional[Callable[[Any], None]]:
    """The engine's checkpoint hook (None when checkpoints are off)."""
    return self.save_checkpoint if self.checkpointer is not None else None

  def finish(self, summary: dict[str, Any]) -> None:
    """Writes summary.json atomically: it marks a finished run, so it is never half written."""
    self._metrics.close()
    with open(self._file("summary.json.tmp"), "w") as f:
      json.dump(summary, f, indent=2)
      f.write("\n")
    os.replace(self._file("summary.json.tmp"), self._file("summary.json"))

  def last_checkpoint(self) -> str:
    """What a failed run leaves behind, in words."""
    last = self.checkpointer.steps()[-1:] if self.checkpointer is not None else []
    return (f"checkpoint {last[0]} is intact: re-run the same command to resume" if last
            else "no checkpoint was written")

  def close(self) -> None:
    if self._metrics is not None and not self._metrics.closed:
      self._metrics.close()
    if self.checkpointer is not None:
      self.checkpointer.close()
