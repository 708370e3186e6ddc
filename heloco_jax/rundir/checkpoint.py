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
import numbers
import os
import re
import shutil
import warnings
import zlib
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from heloco_jax.training import sharding

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


@jax.jit
def _fingerprint(x: jax.Array) -> jax.Array:
  """A position-weighted sum of ``x``'s bits, mod 2³² (integer adds: the same on any mesh).
  Checks a sharded leaf where a CRC32 would need its bytes on one host."""
  if x.dtype == jnp.bool_:
    words = x.astype(jnp.uint32)
  else:
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    words = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
  words = words.ravel()
  weights = jnp.arange(words.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
  return jnp.sum(words * weights, dtype=jnp.uint32)


@jax.jit
def _fingerprints(leaves: list[jax.Array]) -> list[jax.Array]:
  return [_fingerprint(leaf) for leaf in leaves]


def pack(tree: Any) -> tuple[dict[str, Any], Meta]:
  """Packs ``tree``'s arrays into one flat numpy array per dtype; sharded ones stay as they are.

  Args:
    tree: a pytree of arrays (typed PRNG keys must be converted to their
      key data first).

  Returns:
    ``{dtype name: 1-D array}`` plus ``{"leafI": jax.Array}`` for each leaf I
    spread over several devices (orbax writes those shard by shard, each
    process its own), and the layout: the tree structure (as text, for
    checking), each leaf's ``[dtype, shape]`` (``[dtype, shape, "sharded",
    where]`` for a spread one: ``_where``), each packed array's CRC32 and each
    spread leaf's ``_fingerprint``.
  """
  leaves, treedef = jax.tree.flatten(tree)
  spread = [i for i, leaf in enumerate(leaves) if sharding.is_spread(leaf)]  # never gathered
  kept = set(spread)
  # One program per device set (a worker's group, θ's mesh), one at a time, once the run's
  # own work is done: host CPU devices run collectives on a small thread pool, and programs
  # with collectives in flight at once can wait on each other for ever (XLA's rendezvous
  # then aborts the process).
  jax.block_until_ready([leaves[i] for i in spread])
  by_devices: dict[frozenset, list[int]] = {}
  for i in spread:
    by_devices.setdefault(frozenset(leaves[i].sharding.device_set), []).append(i)
  fingerprints = {}
  for indices in by_devices.values():
    values = jax.device_get(_fingerprints([leaves[i] for i in indices]))
    fingerprints.update({f"leaf{i}": value for i, value in zip(indices, values)})
  host = jax.device_get([None if i in kept else leaf for i, leaf in enumerate(leaves)])
  groups: dict[str, list[np.ndarray]] = {}
  entries = []
  for i, leaf in enumerate(leaves):
    if i in kept:
      entries.append([jnp.dtype(leaf.dtype).name, list(leaf.shape), "sharded",
                      _where(leaf.sharding)])
      continue
    leaf = np.asarray(host[i])
    groups.setdefault(leaf.dtype.name, []).append(leaf.ravel())
    entries.append([leaf.dtype.name, list(leaf.shape)])
  packed: dict[str, Any] = {name: np.concatenate(parts) for name, parts in groups.items()}
  packed.update({f"leaf{i}": leaves[i] for i in spread})
  layout = {"treedef": str(treedef), "leaves": entries,
            "crc32": {name: zlib.crc32(packed[name].tobytes()) for name in groups},
            "fingerprint": {name: int(value) for name, value in fingerprints.items()}}
  return packed, layout


def unpack(packed: dict[str, Any], layout: Meta, template: Any) -> Any:
  """Inverts ``pack`` into ``template``'s tree structure (arrays are ``jax.Array``).

  Args:
    packed: the packed arrays (a spread leaf's as restored, with its sharding).
    layout: ``pack``'s layout.
    template: a pytree with the structure, shapes and dtypes the state must
      have (arrays or ``jax.ShapeDtypeStruct``).

  Raises:
    ValueError: the checksums, structure, shapes or dtypes do not match.
  """
  packed = {name: array if name.startswith("leaf") else np.asarray(array)
            for name, array in packed.items()}
  for name, crc in layout["crc32"].items():
    if name not in packed or zlib.crc32(packed[name].tobytes()) != crc:
      raise ValueError(f"its {name} arrays fail their checksum")
  for name, value in layout.get("fingerprint", {}).items():
    if name not in packed or int(_fingerprint(packed[name])) != value:
      raise ValueError(f"its sharded array {name} fails its checksum")
  leaves, treedef = jax.tree.flatten(template)
  expected = [[jnp.dtype(leaf.dtype).name, list(leaf.shape)] for leaf in leaves]
  if str(treedef) != layout["treedef"] or expected != [e[:2] for e in layout["leaves"]]:
    raise ValueError("the checkpoint's state has another structure or other shapes than this "
                     "run's (a different model, number of workers or method)")
  offsets = {name: 0 for name in packed}
  out = []
  for i, (name, shape, *sharded) in enumerate(layout["leaves"]):
    if sharded:
      out.append(packed[f"leaf{i}"])
      continue
    size = int(np.prod(shape, dtype=np.int64))
    start = offsets[name]
    out.append(jnp.asarray(packed[name][start:start + size].reshape(shape)))
    offsets[name] = start + size
  return jax.tree.unflatten(treedef, out)


def _remove_unfinished(directory: str) -> None:
  """Deletes the checkpoints a killed run left half written (``N.orbax-checkpoint-tmp-*``),
  here and now: orbax's own clean-up runs in a background thread, which a refused resume that
  closes the manager at once interrupts with a 50-line traceback (issue 61). Process 0 alone
  (the checkpoints folder is shared); a link is removed, never followed."""
  if jax.process_index() != 0:
    return
  for name in os.listdir(directory):
    if ".orbax-checkpoint-tmp" not in name:
      continue
    path = os.path.join(directory, name)
    if os.path.islink(path) or not os.path.isdir(path):
      os.unlink(path)
    else:
      shutil.rmtree(path)


class Checkpointer:
  """Saves and restores a run's whole state under ``directory``.

  Args:
    directory: the checkpoints folder (created if missing).
    keep: how many of the newest checkpoints to keep (>= 1).
  """

  def __init__(self, directory: str, keep: int = 3):
    if isinstance(keep, bool) or not (isinstance(keep, numbers.Integral) and keep >= 1):
      raise ValueError(f"Checkpointer: keep={keep!r} is not allowed; allowed: an integer >= 1.")
    self.directory = os.path.abspath(directory)
    try:
      os.makedirs(self.directory, exist_ok=True)
      _remove_unfinished(self.directory)
      self._manager = ocp.CheckpointManager(
          self.directory, item_names=("arrays", "meta"),
          options=ocp.CheckpointManagerOptions(
              max_to_keep=keep, enable_async_checkpointing=False,
              cleanup_tmp_directories=False))
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
    packed, layout = pack(arrays)  # sharded arrays stay on their devices
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

  def _save(self, step: int, packed: dict[str, Any], layout: Meta, meta: Meta) -> None:
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
        meta = _verified_meta(self._manager, candidate)
        refusal = accept(meta) if accept is not None else None
        if refusal:
          raise ValueError(refusal)
        layout = meta.pop("layout")
        abstract = template(meta)
        packed = self._manager.restore(candidate, args=ocp.args.Composite(
            arrays=ocp.args.StandardRestore(_packed_shapes(layout, abstract)))).arrays
        arrays = unpack(packed, layout, abstract)
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

  def drop_before(self, step: int) -> None:
    """Deletes the checkpoints older than ``step`` (e.g. a finished run's, but its last)."""
    for older in [s for s in self.steps() if s < step]:
      self._manager.delete(older)
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()


def _verified_meta(manager: ocp.CheckpointManager, step: int) -> Meta:
  """Checkpoint ``step``'s meta, its CRC32 checked (and removed); ValueError if it fails."""
  meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
  if meta.pop("crc32", None) != meta_checksum(meta):  # a missing one fails too
    raise ValueError("its metadata fails its checksum (or has none)")
  return meta


def newest_meta(directory: str) -> Optional[Meta]:
  """The meta of the newest checkpoint under ``directory`` that verifies (the run's clock and
  counters: e.g. ``units`` and ``sim_time``, where a resume starts), or None where there is
  none. Read only: nothing is created, written or removed, so the run may be running."""
  if not os.path.isdir(directory):
    return None
  try:
    with _quiet_orbax():
      manager = ocp.CheckpointManager(
          os.path.abspath(directory), item_names=("arrays", "meta"),
          options=ocp.CheckpointManagerOptions(read_only=True, create=False))
      try:
        for step in sorted(manager.all_steps(), reverse=True):
          try:
            return _verified_meta(manager, step)
          except Exception:  # pylint: disable=broad-except  (unreadable: the next older)
            continue
      finally:
        manager.close()
  except Exception:  # pylint: disable=broad-except  (not a checkpoints folder)
    return None
  return None


def _packed_shapes(layout: Meta, template: Any) -> dict[str, jax.ShapeDtypeStruct]:
  """The packed arrays' abstract shapes, from the layout; a sharded leaf's with the sharding
  of ``template``'s leaf (restored onto it shard by shard: another mesh shape works too), or,
  when that has none, the one it was saved with (``_sharding_at``)."""
  sizes: dict[str, int] = {}
  shapes: dict[str, jax.ShapeDtypeStruct] = {}
  targets = jax.tree.leaves(template)
  for i, (name, shape, *sharded) in enumerate(layout["leaves"]):
    if sharded:
      target = getattr(targets[i], "sharding", None) if i < len(targets) else None
      shapes[f"leaf{i}"] = jax.ShapeDtypeStruct(
          tuple(shape), jnp.dtype(name),
          sharding=target or _sharding_at(sharded[1:]))
      continue
    sizes[name] = sizes.get(name, 0) + int(np.prod(shape, dtype=np.int64))
  shapes.update({name: jax.ShapeDtypeStruct((size,), jnp.dtype(name))
                 for name, size in sizes.items()})
  return shapes


def _where(sharding: jax.sharding.Sharding) -> Optional[Meta]:
  """A ``NamedSharding`` as JSON (its mesh's device ids, shape and axis names, and its
  spec), for ``_sharding_at``; None for another kind."""
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return None
  spec = [list(axis) if isinstance(axis, tuple) else axis for axis in sharding.spec]
  return {"devices": [int(d.id) for d in sharding.mesh.devices.flat],
          "mesh": dict(sharding.mesh.shape), "spec": spec}


def _sharding_at(where: list) -> jax.sharding.Sharding:
  """The sharding a spread leaf was saved with (``_where``) when this process sees those
  devices (a run resumed where it ran: with ``jax.distributed``, devices of other processes
  too); else the first device (a checkpoint of an older version, or of other devices)."""
  devices = {d.id: d for d in jax.devices()}
  saved = where[0] if where else None
  if not saved or any(i not in devices for i in saved["devices"]):
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])
  mesh = jax.sharding.Mesh(np.array([devices[i] for i in saved["devices"]]).reshape(
      tuple(saved["mesh"].values())), tuple(saved["mesh"]))
  spec = [tuple(axis) if isinstance(axis, list) else axis for axis in saved["spec"]]
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
