"""A tree's leaves packed into one buffer per dtype, for the server's outer step
(docs/ALGORITHMS.md, "Packed outer state").

An outer step over a tree of many leaves runs one small kernel per leaf and op; on an
accelerator that is launch-bound far below memory bandwidth. ``pack`` lays the leaves
of each dtype end to end in one ``[rows, BLOCK]`` buffer, each leaf starting on a row
of its own (zero-padded to a whole row), so:

* elementwise rules (every registry rule, ``optax.sgd``) run on a ``Packed`` as on any
  pytree: one pass per buffer;
* a per-leaf reduction (HeLoCo's ⟨Δ, m⟩, |Δ|², |m|²) is a row sum and a sum over each
  leaf's rows (``leaf_sums``), and a per-leaf scalar reaches its rows by one gather
  of a row-length index (``Parts.take``);
* the padding stays zero through every such rule (0 in, 0 out).

The sums add in another order than ``jnp.vdot`` per leaf, so packed and tree steps agree
within float32 rounding, not bit for bit (tests/outer/test_outer_reference.py and
tests/training/test_server.py state the tolerances). Rules that read a tree's structure
(``optax.masked``, per-leaf trust ratios, factored second moments) must not be packed: the
engine packs registry rules only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 1024  # elements per row: a leaf wastes < one row; a row sum is one short reduction


@dataclasses.dataclass(frozen=True)
class PackedLayout:
  """Where each leaf of a tree sits in the per-dtype buffers: static (a ``Packed``'s pytree
  metadata), equal for trees of the same structure, shapes and dtypes.

  Attributes:
    treedef: the tree's structure.
    shapes: per leaf, its shape.
    dtypes: per leaf, its dtype's name.
    buffer_dtypes: per buffer, its dtype's name (first-seen order).
    buffer_of: per leaf, the index of its buffer.
    first_row: per leaf, its first row in that buffer.
    num_rows: per leaf, its rows (⌈size / BLOCK⌉).
    buffer_rows: per buffer, its rows.
  """
  treedef: Any
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[str, ...]
  buffer_dtypes: tuple[str, ...]
  buffer_of: tuple[int, ...]
  first_row: tuple[int, ...]
  num_rows: tuple[int, ...]
  buffer_rows: tuple[int, ...]

  @property
  def num_leaves(self) -> int:
    return len(self.shapes)

  @functools.cached_property
  def row_leaf(self) -> tuple[np.ndarray, ...]:
    """Per buffer, the (tree-order) leaf index of each of its rows."""
    rows = [np.zeros(n, np.int32) for n in self.buffer_rows]
    for leaf, (b, first, n) in enumerate(zip(self.buffer_of, self.first_row, self.num_rows)):
      rows[b][first:first + n] = leaf
    return tuple(rows)


@functools.lru_cache(maxsize=64)
def layout_of(treedef: Any, shapes: tuple[tuple[int, ...], ...],
              dtypes: tuple[str, ...]) -> PackedLayout:
  """The layout of a tree with these leaves (cached: its ``row_leaf`` is built once)."""
  buffer_dtypes = tuple(dict.fromkeys(dtypes))
  buffer_of = tuple(buffer_dtypes.index(d) for d in dtypes)
  rows_used = [0] * len(buffer_dtypes)
  first_row, num_rows = [], []
  for shape, b in zip(shapes, buffer_of):
    n = -(-math.prod(shape) // BLOCK)
    first_row.append(rows_used[b])
    num_rows.append(n)
    rows_used[b] += n
  return PackedLayout(treedef, shapes, dtypes, buffer_dtypes, buffer_of, tuple(first_row),
                      tuple(num_rows), tuple(rows_used))


@jax.tree_util.register_pytree_node_class
class Packed:
  """A tree packed into ``buffers`` (one ``[rows, BLOCK]`` array per dtype), a pytree whose
  children are the buffers: optax's tree maps run over them unchanged."""

  def __init__(self, buffers: tuple[Any, ...], layout: PackedLayout):
    self.buffers = tuple(buffers)
    self.layout = layout

  def tree_flatten(self) -> tuple[tuple[Any, ...], PackedLayout]:
    return self.buffers, self.layout

  @classmethod
  def tree_unflatten(cls, layout: PackedLayout, buffers: Any) -> "Packed":
    return cls(tuple(buffers), layout)

  def __repr__(self) -> str:
    return (f"Packed({self.layout.num_leaves} leaves in {len(self.buffers)} buffer(s) of "
            f"{list(self.layout.buffer_rows)} × {BLOCK})")


def pack(tree: Any) -> Packed:
  """``tree``'s leaves in one zero-padded ``[rows, BLOCK]`` buffer per dtype."""
  leaves, treedef = jax.tree.flatten(tree)
  layout = layout_of(treedef, tuple(tuple(np.shape(x)) for x in leaves),
                     tuple(jnp.dtype(x.dtype).name for x in leaves))
  buffers = []
  for b, (dtype, rows) in enumerate(zip(layout.buffer_dtypes, layout.buffer_rows)):
    # Each leaf, then the zeros to its last row's end, in one concatenation (on a 2-core
    # CPU 1.7x faster than a pad per leaf: 23 vs 40 ms at 14.5M parameters).
    parts = []
    for x, owner, n in zip(leaves, layout.buffer_of, layout.num_rows):
      if owner == b and n:
        parts.append(jnp.ravel(x))
        if n * BLOCK > x.size:
          parts.append(jnp.zeros((n * BLOCK - x.size,), x.dtype))
    flat = jnp.concatenate(parts) if parts else jnp.zeros((0,), dtype)
    buffers.append(flat.reshape(rows, BLOCK))
  return Packed(tuple(buffers), layout)


def unpack(packed: Packed) -> Any:
  """The tree ``pack`` was given (values, shapes and dtypes; the buffers' dtypes where a
  rule changed them, e.g. a float32 momentum of a bfloat16 θ)."""
  layout = packed.layout
  leaves = []
  for shape, b, first, n in zip(layout.shapes, layout.buffer_of, layout.first_row,
                                layout.num_rows):
    buffer = packed.buffers[b]
    leaves.append(buffer[first:first + n].reshape(-1)[:math.prod(shape)].reshape(shape))
  return layout.treedef.unflatten(leaves)


def unpack_all(tree: Any) -> Any:
  """``tree`` with every ``Packed`` inside it unpacked (e.g. an outer state)."""
  return jax.tree.map(lambda x: unpack(x) if isinstance(x, Packed) else x, tree,
                      is_leaf=lambda x: isinstance(x, Packed))


def pack_like(tree: Any, like: Any) -> Any:
  """``tree`` packed wherever ``like`` (a packed version of a tree of its structure, e.g. a
  server's outer state) holds a ``Packed``."""
  is_packed = lambda x: isinstance(x, Packed)
  refs, structure = jax.tree.flatten(like, is_leaf=is_packed)
  return structure.unflatten([pack(part) if is_packed(ref) else part
                              for ref, part in zip(refs, structure.flatten_up_to(tree))])


class Parts(NamedTuple):
  """A tree or a ``Packed`` as arrays a per-leaf scalar can scale.

  Attributes:
    arrays: the leaves (a tree) or the buffers (a ``Packed``).
    take: ``(v, i) -> what multiplies arrays[i]``, for ``v`` a scalar or one entry per
      leaf (tree order): ``v[i]``, or per row of buffer ``i`` its leaf's entry.
    rebuild: a list like ``arrays`` -> a tree (or ``Packed``) of the same structure.
    like: a tree (or ``Packed``) of the same structure -> its arrays, in ``arrays``' order.
    num_leaves: the tree's leaves.
  """
  arrays: list[Any]
  take: Callable[[Any, int], Any]
  rebuild: Callable[[list[Any]], Any]
  like: Callable[[Any], list[Any]]
  num_leaves: int


def parts(tree: Any) -> Parts:
  """``tree``'s ``Parts``: its leaves, or a ``Packed``'s buffers."""
  if isinstance(tree, Packed):
    layout = tree.layout
    rows = layout.row_leaf

    def take_rows(v: Any, i: int) -> Any:
      v = jnp.asarray(v)
      return v if v.ndim == 0 else v[rows[i]][:, None]
    return Parts(list(tree.buffers), take_rows, lambda arrays: Packed(tuple(arrays), layout),
                 lambda other: list(other.buffers), layout.num_leaves)
  leaves, treedef = jax.tree.flatten(tree)

  def take_leaf(v: Any, i: int) -> Any:
    v = jnp.asarray(v)
    return v if v.ndim == 0 else v[i]
  return Parts(leaves, take_leaf, treedef.unflatten, treedef.flatten_up_to, len(leaves))


def rows_dot(d: jax.Array, m: jax.Array) -> jax.Array:
  """Per row of two ``[rows, BLOCK]`` buffers, [⟨d, m⟩, |d|², |m|²] as ``[rows, 3]``."""
  return jnp.stack([jnp.sum(d * m, axis=1), jnp.sum(d * d, axis=1), jnp.sum(m * m, axis=1)], 1)


def leaf_sums(delta: Packed, momentum: Packed, cast: Callable[[Any], Any]) -> jax.Array:
  """Per leaf (tree order) [⟨Δ, m⟩, |Δ|², |m|²] as ``[num_leaves, 3]``: row sums, then each
  leaf's rows (a static, contiguous slice of its buffer) summed, in ``cast``'s dtype (applied
  to Δ and m first: a bfloat16 buffer's products then round no coarser than float32).

  Static slices, not ``jax.ops.segment_sum``: on an H200 XLA fused the ⟨Δ, m⟩ row sums
  into the scatter's kernel, one thread summing a whole 1,024-element row, and took 6.3 ms
  for the 86M GPT's 84k rows against 0.63 ms for the slices: the packed HeLoCo step ran at
  0.56x the tree's speed, now 2.1x (docs/BENCHMARKS.md)."""
  layout = delta.layout
  if not layout.num_leaves:
    return jnp.zeros((0, 3), jnp.float32)
  row_sums = [rows_dot(cast(d), cast(m)) for d, m in zip(delta.buffers, momentum.buffers)]
  return jnp.stack([jnp.sum(row_sums[b][first:first + n], axis=0)
                    for b, first, n in zip(layout.buffer_of, layout.first_row, layout.num_rows)])
