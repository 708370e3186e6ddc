"""Metric writers: where a run's history rows go besides ``metrics.jsonl``.

A writer is a callable over history rows (the dicts of DESIGN.md, "Files a run
writes": ``eval``, ``arrival``, ``train`` and ``rejected`` rows) with a ``close()``. It is
what ``hj.simulate(on_row=...)`` takes, so the same writers serve the public API
and the command line (``--config.writers``)::

  writer = hj.TensorBoardWriter("logs/heloco")
  hj.simulate(loss_fn, params, data, on_row=writer)
  writer.close()

TensorBoard goes through tensorboardX (``pip install heloco-jax[tensorboard]``),
which needs neither TensorFlow nor TensorBoard to write; ``tensorboard --logdir``
shows the event files.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable, Optional, Sequence

from heloco_jax.rundir import safe_files

Row = dict[str, Any]

# Arrival-row fields written as scalars (tag: field); HeLoCo's λ and β are its mean rotation
# and shrinkage over blocks (ALGORITHMS.md, "HeLoCo").
_ARRIVAL_SCALARS = {"arrival/staleness": "staleness", "arrival/cosine": "cosine_mean",
                    "arrival/weight": "weight", "heloco/lambda": "rotation_mean",
                    "heloco/beta": "shrinkage_mean",
                    "heloco/relative_correction": "relative_correction"}
WRITERS = ("jsonl", "tensorboard")


def tensorboard_available() -> bool:
  return importlib.util.find_spec("tensorboardX") is not None


def _units(row: Row) -> int:
  """The row's position in the run: its tokens (the CLI), else its steps (the public API)."""
  return int(row.get("tokens", row.get("steps", 0)))


# Eval-row keys that place a row rather than measure the model.
_EVAL_AXES = ("event", "tokens", "steps", "sim_time", "outer_updates")


class TensorBoardWriter:
  """History rows as TensorBoard scalars (tensorboardX event files in ``logdir``).

  - ``eval`` rows: ``val_loss``, ``val_loss/<language>`` and every other number an
    ``eval_fn`` returns (accuracy) against tokens, and ``val_loss_by_sim_second`` against
    simulated seconds;
  - ``arrival`` and ``train`` rows: ``train_loss`` (the mean loss of the inner steps the
    row reports) and ``loss_fn``'s metrics (``train_<name>``) against tokens;
  - ``arrival`` rows, against outer updates: ``arrival/staleness``, ``arrival/cosine``
    (cos(Δ, m)), ``arrival/weight``, ``heloco/lambda``, ``heloco/beta``,
    ``heloco/branch_fraction/<branch>`` and ``progress/sim_time``;
  - ``rejected`` rows: ``arrival/rejected``, the running count.

  Args:
    logdir: the folder of the event files (made if missing).
    flush_secs: seconds between flushes to disk.

  Raises:
    ImportError: tensorboardX is not installed (naming the install command).
  """

  def __init__(self, logdir: str, flush_secs: int = 10):
    try:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
    except ImportError as error:
      raise ImportError("the tensorboard writer needs tensorboardX: pip install "
                        "'heloco-jax[tensorboard]' (or tensorboardX)") from error
    self.logdir = logdir
    self._writer = SummaryWriter(logdir=logdir, flush_secs=flush_secs)
    self._rejected = 0

  def __call__(self, row: Row) -> None:
    scalar = self._writer.add_scalar
    event = row.get("event")
    if event in ("arrival", "train"):  # train_loss and loss_fn's metrics (train_<name>)
      for key, value in row.items():
        if key.startswith("train_") and value is not None:
          scalar(key, value, _units(row))
    if event == "eval":
      tokens = _units(row)
      for key, value in row.items():  # val_loss, val_loss/<language>, eval_fn's metrics
        if (key not in _EVAL_AXES and isinstance(value, (int, float))
            and not isinstance(value, bool)):
          scalar(key, value, tokens)
      seconds = row.get("sim_time", 0)
      if seconds is not None and 0 <= seconds < 2**63:  # a step TensorBoard can hold (int64)
        scalar("val_loss_by_sim_second", row["val_loss"], int(seconds))
    elif event == "arrival":
      step = int(row["outer_updates"])
      for tag, key in _ARRIVAL_SCALARS.items():
        if row.get(key) is not None:
          scalar(tag, row[key], step)
      scalar("progress/sim_time", row["sim_time"], step)
      counts = {k.split("/", 1)[1]: v for k, v in row.items() if k.startswith("branch_count/")}
      total = sum(counts.values())
      for name, count in counts.items():
        if total:
          scalar(f"heloco/branch_fraction/{name}", count / total, step)
    elif event == "rejected":
      self._rejected += 1
      scalar("arrival/rejected", self._rejected, int(row.get("outer_updates", 0)))

  def flush(self) -> None:
    self._writer.flush()

  def close(self) -> None:
    self._writer.close()


class Writers:
  """Several writers as one: each row goes to each, in order; ``close`` closes them all."""

  def __init__(self, writers: Sequence[Callable[[Row], None]]):
    self.writers = list(writers)

  def __call__(self, row: Row) -> None:
    for writer in self.writers:
      writer(row)

  def close(self) -> None:
    for writer in self.writers:
      close = getattr(writer, "close", None)
      if close is not None:
        close()


def parse(spec: str) -> tuple[str, ...]:
  """The writers a ``--config.writers`` value names; "" is jsonl, plus tensorboard when
  tensorboardX is installed.

  Raises:
    ValueError: an unknown writer, a missing jsonl (the run's own record, which resuming
      reads), or tensorboard without tensorboardX.
  """
  if not spec:
    return ("jsonl", "tensorboard") if tensorboard_available() else ("jsonl",)
  names = tuple(name.strip() for name in spec.split(","))
  allowed = "a comma-separated list of jsonl (required), tensorboard; or '' (the default)"
  if any(name not in WRITERS for name in names) or "jsonl" not in names:
    raise ValueError(f"writers={spec!r} is not allowed; allowed: {allowed}")
  if "tensorboard" in names and not tensorboard_available():
    raise ValueError(f"writers={spec!r} needs tensorboardX: pip install "
                     "'heloco-jax[tensorboard]' (or tensorboardX)")
  return names


def for_workdir(names: Sequence[str], workdir: str,
                rows: Sequence[Row] = ()) -> Optional[Writers]:
  """The writers besides jsonl (which the run directory keeps), logging under ``workdir``.

  A resumed run's TensorBoard events are written anew from ``rows`` (the run's
  rows up to its checkpoint, as ``metrics.jsonl`` holds them): the events of
  the earlier parts go, with any written after the checkpoint a kill cut off,
  so that the event files hold exactly an uninterrupted run's scalars.
  """
  extra = []
  if "tensorboard" in names:
    logdir = os.path.join(workdir, "tensorboard")
    safe_files.make_dirs(logdir)  # never writes or deletes through a link
    safe_files.refuse_links_below(logdir)
    if os.path.isdir(logdir):
      for name in os.listdir(logdir):
        if name.startswith("events.out.tfevents."):
          os.remove(os.path.join(logdir, name))
    writer = TensorBoardWriter(logdir)
    for row in rows:
      writer(row)
    extra.append(writer)
  return Writers(extra) if extra else None
