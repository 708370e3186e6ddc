"""Shardings that follow the user's params (docs/DESIGN.md, "Scaling out").

A user who places θ with ``jax.device_put(params, shardings)`` (a
``NamedSharding`` per leaf, on one ``jax.sharding.Mesh``: FSDP over an
``fsdp`` axis, tensor parallel, ...) gets every copy the engine makes with
the same layout. ``Layout`` holds θ's shardings and says where any other
tree the run holds lives:

* a subtree shaped like θ (the same tree structure and leaf shapes: an
  optimizer's moments, a momentum, a pseudo-gradient, a worker's start and
  end parameters) takes θ's shardings, leaf by leaf;
* every other leaf (step counts, per-tensor scalars, HeLoCo's per-block
  statistics) is replicated on the mesh.

Inside a jitted program ``Layout.constrain`` pins its outputs to that layout
(``jax.lax.with_sharding_constraint``, so XLA partitions the program, cosines
and norms included, and inserts the collectives); outside, ``Layout.put``
moves a tree there device to device. K copies of θ stacked on a leading axis
(a synchronous round's replicas, under ``vmap``) keep θ's specs with that
axis unsharded, or split over ``Layout.stack_axis`` (a ``workers`` mesh axis).

θ whose leaves each sit on one device (``jax.numpy`` arrays, NumPy arrays)
has no layout (``layout_of`` returns None): the run is what it was, bit for bit.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def is_spread(leaf: Any) -> bool:
  """Whether ``leaf`` is a ``jax.Array`` over more than one device."""
  return isinstance(leaf, jax.Array) and len(leaf.sharding.device_set) > 1


def layout_of(params: Any) -> Optional["Layout"]:
  """θ's ``Layout``, or None when no leaf is spread over several devices.

  Raises:
    ValueError: a spread leaf whose sharding is not a ``NamedSharding``, or
      leaves on different meshes (the message names the leaf).
  """
  leaves = jax.tree_util.tree_leaves_with_path(params)
  if not any(is_spread(leaf) for _, leaf in leaves):
    return None
  mesh = None
  for path, leaf in leaves:
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding):
      raise ValueError(
          f"params leaf {name!r} is placed with {type(sharding).__name__}; allowed: every leaf a "
          "jax.Array placed with a NamedSharding on one Mesh (jax.device_put(params, "
          "shardings)) when any leaf is spread over several devices")
    if mesh is None:
      mesh = sharding.mesh
    elif sharding.mesh != mesh:
      raise ValueError(f"params leaf {name!r} is on mesh {dict(sharding.mesh.shape)} of other "
                       f"devices than the first leaf's {dict(mesh.shape)}; allowed: one Mesh")
  assert mesh is not None
  return Layout(jax.tree.map(lambda x: x.sharding.spec, params), mesh,
                tuple(tuple(x.shape) for x in jax.tree.leaves(params)))


def on_auto_axes(tree: Any) -> Any:
  """``tree`` with every leaf placed on a mesh of Explicit axes (``jax.make_mesh``'s default)
  moved to the same devices, axis names and specs with ``AxisType.Auto`` axes: the engine's
  programs let XLA partition them (docs/DESIGN.md, "Scaling out"). Other leaves as they are."""
  def place(x: Any) -> Any:
    where = getattr(x, "sharding", None)
    if not isinstance(where, NamedSharding) or all(
        t == jax.sharding.AxisType.Auto for t in where.mesh.axis_types):
      return x
    auto = (jax.sharding.AxisType.Auto,) * len(where.mesh.axis_names)
    return jax.device_put(x, NamedSharding(where.mesh.update(axis_types=auto), where.spec))
  return jax.tree.map(place, tree)


def fsdp_specs(params: Any, axis: str, size: int) -> Any:
  """FSDP partition specs: each leaf split over ``axis`` (of ``size`` devices) along its
  largest dimension that ``size`` divides; a leaf with none is replicated."""
  def spec(leaf: Any) -> P:
    shape = _shape(leaf)
    dims = [d for d in sorted(range(len(shape)), key=lambda d: -shape[d]) if shape[d] % size == 0]
    if not dims or size == 1:
      return P()
    return P(*[axis if d == dims[0] else None for d in range(len(shape))])
  return jax.tree.map(spec, params)


def specs_by_path(params: Any, rules: Sequence[tuple[str, P]], mesh: Mesh,
                  default: Optional[Callable[[Any], P]] = None) -> Any:
  """Partition specs by parameter path: each leaf takes the spec of the first rule whose
  regular expression is found in its path (``"blocks/0/up/kernel"``), else ``default(leaf)``
  (None: replicated).

  Raises:
    ValueError: a rule's spec does not divide its leaf's shape on ``mesh`` (names the leaf).
  """
  def spec(path: Any, leaf: Any) -> P:
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    for pattern, rule in rules:
      if re.search(pattern, name):
        for size, axis in zip(_shape(leaf), rule):
          ways = int(np.prod([mesh.shape[a] for a in
                              ((axis,) if isinstance(axis, str) else axis or ())]))
          if size % ways:
            raise ValueError(f"the sharding rule {pattern!r} -> {rule} does not fit the leaf "
                             f"{name!r} of shape {_shape(leaf)} on mesh {dict(mesh.shape)}; "
                             "allowed: dimensions the mesh axes divide")
        return rule
    return default(leaf) if default is not None else P()
  return jax.tree_util.tree_map_with_path(spec, params)


def put_fsdp(params: Any, devices: Any, axis: str = "fsdp") -> Any:
  """``params`` FSDP-sharded (``fsdp_specs``) over a one-axis mesh of ``devices``."""
  mesh = Mesh(np.array(list(devices)), (axis,))
  return put(params, mesh, fsdp_specs(params, axis, mesh.size))


def put(params: Any, mesh: Mesh, specs: Any) -> Any:
  """``params`` placed on ``mesh`` with ``specs`` (a tree of ``PartitionSpec``s)."""
  return jax.device_put(params, jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs))


def _is_none(node: Any) -> bool:
  return node is None


def _shape(leaf: Any) -> tuple[int, ...]:
  return tuple(getattr(leaf, "shape", np.shape(leaf)))


@dataclasses.dataclass(frozen=True)
class Layout:
  """θ's partition specs on a mesh, and the layout of any tree the run holds.

  Attributes:
    specs: θ's tree of ``PartitionSpec``s.
    mesh: the devices (and axis names) they refer to.
    shapes: θ's leaf shapes, in leaf order.
    stack_axis: the mesh axis K stacked copies of θ are split over (a round's
      replicas on a ``workers`` × θ's axes mesh); None: not split.
  """
  specs: Any
  mesh: Mesh
  shapes: tuple[tuple[int, ...], ...]
  stack_axis: Optional[str] = None

  def on(self, mesh: Mesh, stack_axis: Optional[str] = None) -> "Layout":
    """The same partition specs on ``mesh`` (a worker's group: the same axis names; a
    round's mesh: ``stack_axis`` and the same axis names)."""
    return dataclasses.replace(self, mesh=mesh, stack_axis=stack_axis)

  def _stacking(self, node: Any) -> Optional[int]:
    """0 when ``node`` is shaped like θ, 1 when like K copies of θ stacked on a leading axis,
    None otherwise. A fragment of θ (``heloco_jax.comm.fragments``: θ's structure with the
    other fragments' leaves None) is shaped like θ where it has leaves."""
    if node is None or (jax.tree.structure(node, is_leaf=_is_none)
                        != jax.tree.structure(self.specs)):
      return None
    pairs = [(_shape(leaf), shape) for leaf, shape in zip(
        jax.tree.leaves(node, is_leaf=_is_none), self.shapes) if leaf is not None]
    if not pairs:
      return None
    if all(have == want for have, want in pairs):
      return 0
    if (len({have[:1] for have, _ in pairs}) == 1
        and all(have[1:] == want for have, want in pairs)):
      return 1
    return None

  def shardings(self, tree: Any) -> Any:
    """``tree``'s shardings: θ's on θ-shaped subtrees and fragments of θ (stacked ones split
    over ``stack_axis`` on their leading axis), replicated on every other leaf."""
    replicated = NamedSharding(self.mesh, P())

    def place(node: Any) -> Any:
      stacked = self._stacking(node)
      if stacked is None:
        return replicated
      return jax.tree.map(
          lambda spec, leaf: None if leaf is None else NamedSharding(
              self.mesh, P(*[self.stack_axis] * stacked, *spec)),
          self.specs, node, is_leaf=_is_none)
    return jax.tree.map(place, tree, is_leaf=lambda node: self._stacking(node) is not None)

  def constrain(self, tree: Any) -> Any:
    """``tree`` pinned to its layout, inside a jitted program (``with_sharding_constraint``)."""
    return jax.lax.with_sharding_constraint(tree, self.shardings(tree))

  def put(self, tree: Any) -> Any:
    """``tree`` moved to its layout (device to device; host values are copied there)."""
    return jax.device_put(tree, self.shardings(tree))

  def from_host(self, tree: Any) -> Any:
    """``tree`` (arrays, or ``HostShards`` from another process) placed on its layout."""
    return from_host(tree, self.shardings(tree))

  @property
  def recipe(self) -> tuple[Any, dict[str, int], tuple[tuple[int, ...], ...]]:
    """(specs, mesh axis sizes, shapes): the layout without its devices, for another process
    to rebuild on its own (``layout_on``)."""
    return self.specs, dict(self.mesh.shape), self.shapes


def layout_on(specs: Any, mesh_shape: dict[str, int], shapes: tuple[tuple[int, ...], ...],
              devices: Sequence[jax.Device]) -> Layout:
  """θ's specs on a mesh of the first of ``devices`` with ``mesh_shape``'s axis names and
  sizes: a ``Layout.recipe`` rebuilt in another process (a Ray actor).

  Raises:
    ValueError: fewer devices than the mesh needs (one line).
  """
  size = int(np.prod(list(mesh_shape.values()), dtype=np.int64))
  if len(devices) < size:
    raise ValueError(f"params sharded over a mesh {mesh_shape} of {size} devices need {size} "
                     f"devices in every process that holds a copy; this one has "
                     f"{len(devices)}; allowed: give each Ray actor as many (ray.gpus_per_worker, "
                     "ray.server_gpus, or XLA_FLAGS on CPU)")
  mesh = Mesh(np.array(list(devices)[:size]).reshape(tuple(mesh_shape.values())),
              tuple(mesh_shape))
  return Layout(specs, mesh, shapes)


@dataclasses.dataclass(frozen=True)
class HostShards:
  """A spread array as its distinct shards on the host: how it crosses between processes
  that share no devices (Ray actors). Each shard travels once; where the receiving mesh
  splits it alike, no whole copy is ever made.

  Attributes:
    shape: the array's shape.
    dtype: its dtype.
    shards: ``((start, stop) per dimension, values)`` for each distinct shard.
  """
  shape: tuple[int, ...]
  dtype: Any
  shards: tuple[tuple[tuple[tuple[int, int], ...], np.ndarray], ...]


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
  return tuple(part.indices(size)[:2] for part, size in zip(index, shape))


def to_host(tree: Any) -> Any:
  """``tree`` on the host: spread arrays as ``HostShards``, others as NumPy values."""
  def get(x: Any) -> Any:
    if not is_spread(x):
      return jax.device_get(x)
    distinct: dict[tuple[tuple[int, int], ...], Any] = {}
    for shard in x.addressable_shards:
      distinct.setdefault(_bounds(shard.index, x.shape), shard.data)
    values = jax.device_get(list(distinct.values()))
    return HostShards(tuple(x.shape), x.dtype, tuple(zip(distinct, map(np.asarray, values))))
  return jax.tree.map(get, tree)


def from_host(tree: Any, shardings: Any) -> Any:
  """``tree`` (arrays or ``HostShards``) placed with ``shardings``, shard by shard."""
  def put(x: Any, where: jax.sharding.Sharding) -> Any:
    if not isinstance(x, HostShards):
      return jax.device_put(x, where)
    pieces = dict(x.shards)
    whole: list[np.ndarray] = []

    def piece(index: tuple[slice, ...]) -> np.ndarray:
      bounds = _bounds(index, x.shape)
      if bounds in pieces:
        return pieces[bounds]
      if not whole:  # split otherwise than the sender's mesh: assembled once, on the host
        full = np.empty(x.shape, x.dtype)
        for part, values in x.shards:
          full[tuple(slice(*b) for b in part)] = values
        whole.append(full)
      return whole[0][index]
    return jax.make_array_from_callback(x.shape, where, piece)
  return jax.tree.map(put, tree, shardings)
