"""Whole-run checkpoints with orbax (DESIGN.md, "Files a run writes": ``DIR/checkpoints/``).

A checkpoint is two orbax items, written by one ``ocp.CheckpointManager``
step (numbered by the run's outer-update count):

  * ``arrays``: every array of the run state, packed into one flat array per
    dtype (``pack``). The simulated runtime's state is ~1,000 small leaves
    (θ, the outer state, K workers' inner states and pending pseudo-gradients);
    orbax's per-array cost makes packing ~6× faster to save and restore, and
    concatenation and slicing are exact. Each packed array carries a CRC32 in
    the metadata, so a file that was cut short or overwritten is detected.
  * ``meta``: JSON: the host-side state (clock, event queue, counters, data
    positions, ...), the packing layout and the checksums, with a CRC32 of
    its own, so that an edited or damaged metadata file is detected too.

Orbax writes a step into a temporary directory and renames it when complete,
so a step is either whole or absent; a save that fails (a full disk, an
unwritable directory) raises ``CheckpointError`` and leaves the earlier steps
as they were. ``restore`` walks back from the newest step and falls back,
with a ``CheckpointFallbackWarning``, past any step it cannot read or verify
(or that the caller does not accept).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import warnings
import zlib
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

Meta = dict[str, Any]
# The abstract state a checkpoint must hold, given its metadata (see ``restore``).
Template = Callable[[Meta], Any]


class CheckpointError(RuntimeError):
  """A checkpoint could not be written, or none of them can be read."""


class CheckpointFallbackWarning(UserWarning):
  """The newest checkpoint could not be read; an older one is used."""


@contextlib.contextmanager
def _quiet_orbax():
  """Silences orbax's own error logs (tracebacks from its writer threads): its failures
  reach the caller as one ``CheckpointError`` line instead."""
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.CRITICAL)
  try:
    yield
  finally:
    logger.setLevel(level)


def _reason(error: BaseException) -> str:
  """A failed save's cause in a few words: the OS error inside orbax's and tensorstore's
  messages when there is one (e.g. "No space left on device"), else the first line."""
  text = str(error)
  code = re.search(r"os_error_code='?(\d+)|OS error (\d+)", text)
  if code:
    return os.strerror(int(code.group(1) or code.group(2)))
  if getattr(error, "strerror", None):
    return error.strerror
  return text.splitlines()[0][:300] if text else type(error).__name__


def meta_checksum(meta: Meta) -> int:
  """CRC32 of ``meta`` as canonical JSON (sorted keys), without its own checksum."""
  body = {key: value for key, value in meta.items() if key != "crc32"}
  return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def pack(tree: Any) -> tuple[dict[str, np.ndarray], Meta]:
  """Packs ``tree``'s arrays into one flat numpy array per dtype.

  Args:
    tree: a pytree of arrays (typed PRNG keys must be converted to their
      key data first).

  Returns:
    ``{dtype name: 1-D array}`` and the layout: the tree structure (as text,
    for checking), each leaf's ``[dtype, shape]`` and each packed array's CRC32.
  """
  leaves, treedef = jax.tree.flatten(jax.device_get(tree))
  leaves = [np.asarray(leaf) for leaf in leaves]
  groups: dict[str, list[np.ndarray]] = {}
  for leaf in leaves:
    groups.setdefault(leaf.dtype.name, []).append(leaf.ravel())
  packed = {name: np.concatenate(parts) for name, parts in groups.items()}
  layout = {"treedef": str(treedef),
            "leaves": [[leaf.dtype.name, list(leaf.shape)] for leaf in leaves],
            "crc32": {name: zlib.crc32(array.tobytes()) for name, array in packed.items()}}
  return packed, layout


def unpack(packed: dict[str, Any], layout: Meta, template: Any) -> Any:
  """Inverts ``pack`` into ``template``'s tree structure (arrays are ``jax.Array``).

  Args:
    packed: the packed arrays.
    layout: ``pack``'s layout.
    template: a pytree with the structure, shapes and dtypes the state must
      have (arrays or ``jax.ShapeDtypeStruct``).

  Raises:
    ValueError: the checksums, structure, shapes or dtypes do not match.
  """
  packed = {name: np.asarray(array) for name, array in packed.items()}
  for name, crc in layout["crc32"].items():
    if name not in packed or zlib.crc32(packed[name].tobytes()) != crc:
      raise ValueError(f"its {name} arrays fail their checksum")
  leaves, treedef = jax.tree.flatten(template)
  expected = [[jnp.dtype(leaf.dtype).name, list(leaf.shape)] for leaf in leaves]
  if str(treedef) != layout["treedef"] or expected != layout["leaves"]:
    raise ValueError("the checkpoint's state has another structure or other shapes than this "
                     "run's (a different model, number of workers or method)")
  offsets = {name: 0 for name in packed}
  out = []
  for name, shape in layout["leaves"]:
    size = int(np.prod(shape, dtype=np.int64))
    start = offsets[name]
    out.append(jnp.asarray(packed[name][start:start + size].reshape(shape)))
    offsets[name] = start + size
  return jax.tree.unflatten(treedef, out)


class Checkpointer:
  """Saves and restores a run's whole state under ``directory``.

  Args:
    directory: the checkpoints folder (created if missing).
    keep: how many of the newest checkpoints to keep (>= 1).
  """

  def __init__(self, directory: str, keep: int = 3):
    if not (isinstance(keep, int) and keep >= 1):
      raise ValueError(f"Checkpointer: keep={keep!r} is not allowed; allowed: an integer >= 1.")
    self.directory = os.path.abspath(directory)
    try:
      os.makedirs(self.directory, exist_ok=True)
      self._manager = ocp.CheckpointManager(
          self.directory, item_names=("arrays", "meta"),
          options=ocp.CheckpointManagerOptions(
              max_to_keep=keep, enable_async_checkpointing=False,
              cleanup_tmp_directories=True))
    except OSError as error:
      raise CheckpointError(f"cannot write checkpoints to {self.directory}: "
                            f"{error.strerror or error}") from None

  def steps(self) -> list[int]:
    """The complete checkpoints' steps, oldest first."""
    return sorted(self._manager.all_steps())

  def save(self, step: int, arrays: Any, meta: Meta) -> None:
    """Writes checkpoint ``step`` (synchronously; whole or not at all).

    Args:
      step: the checkpoint's number (the run's outer-update count); an
        existing step of that number (from after the checkpoint a run resumed
        from, e.g. a corrupt one) is replaced.
      arrays: a pytree of arrays.
      meta: JSON-serialisable host state.

    Raises:
      CheckpointError: it could not be written (the earlier ones are intact).
    """
    packed, layout = pack(arrays)
    try:
      with _quiet_orbax():
        self._save(step, packed, layout, meta)
    except Exception as error:  # pylint: disable=broad-except  (OSError, or orbax's and
      # tensorstore's own errors for a full disk: ValueError, RuntimeError, ...)
      try:
        steps = [s for s in self.steps() if s != step]
      except Exception:  # pylint: disable=broad-except
        steps = []
      kept = f"checkpoint {steps[-1]} is intact" if steps else "there is no earlier checkpoint"
      raise CheckpointError(f"could not write checkpoint {step} to {self.directory}: "
                            f"{_reason(error)}; {kept}") from None

  def _save(self, step: int, packed: dict[str, np.ndarray], layout: Meta, meta: Meta) -> None:
    if step in self._manager.all_steps():  # left by a timeline a resume abandoned
      self._manager.delete(step)
    meta = {**meta, "layout": layout}
    meta["crc32"] = meta_checksum(meta)
    self._manager.save(step, args=ocp.args.Composite(
        arrays=ocp.args.StandardSave(packed), meta=ocp.args.JsonSave(meta)), force=True)
    self._manager.wait_until_finished()

  def restore(self, template: Template, step: Optional[int] = None,
              accept: Optional[Callable[[Meta], Optional[str]]] = None
              ) -> Optional[tuple[int, Any, Meta]]:
    """The newest readable checkpoint (or checkpoint ``step``), or None if there is none.

    Args:
      template: maps a checkpoint's meta to the abstract state its arrays
        must fill (structure, shapes, dtypes).
      step: restore exactly this step (no fallback).
      accept: given a checkpoint's verified meta, the reason not to use it
        (then the next older one is tried, as for an unreadable one), or None.

    Returns:
      ``(step, arrays, meta)``; None when the directory holds no checkpoint.

    Raises:
      CheckpointError: checkpoints exist but none can be read (or ``step``
        cannot).
    """
    steps = self.steps() if step is None else [step]
    if not steps:
      return None
    failures = []
    for candidate in reversed(steps):
      try:
        meta = self._manager.restore(candidate, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore())).meta
        if meta.pop("crc32", None) != meta_checksum(meta):  # a missing one fails too
          raise ValueError("its metadata fails its checksum (or has none)")
        refusal = accept(meta) if accept is not None else None
        if refusal:
          raise ValueError(refusal)
        layout = meta.pop("layout")
        packed = self._manager.restore(candidate, args=ocp.args.Composite(
            arrays=ocp.args.StandardRestore(_packed_shapes(layout)))).arrays
        arrays = unpack(packed, layout, template(meta))
      except Exception as error:  # pylint: disable=broad-except
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        failures.append(f"checkpoint {candidate}: {reason}")
        continue
      if failures:
        warnings.warn(f"{'; '.join(failures)}; resuming from checkpoint {candidate} instead",
                      CheckpointFallbackWarning, stacklevel=2)
      return candidate, arrays, meta
    raise CheckpointError(f"no readable checkpoint in {self.directory} ({'; '.join(failures)}); "
                          "checkpoints written with another config resume only with that "
                          "config; to start over, use a new workdir")

  def drop_after(self, step: int) -> None:
    """Deletes the checkpoints newer than ``step`` (a timeline a resume abandoned)."""
    for newer in [s for s in self.steps() if s > step]:
      self._manager.delete(newer)
    self._manager.wait_until_finished()  # deletions may run on orbax's own threads

  def close(self) -> None:
    self._manager.close()


def _packed_shapes(layout: Meta) -> dict[str, jax.ShapeDtypeStruct]:
  """The packed arrays' abstract shapes, from the layout."""
  sizes: dict[str, int] = {}
  for name, shape in layout["leaves"]:
    sizes[name] = sizes.get(name, 0) + int(np.prod(shape, dtype=np.int64))
  return {name: jax.ShapeDtypeStruct((size,), jnp.dtype(name)) for name, size in sizes.items()}
