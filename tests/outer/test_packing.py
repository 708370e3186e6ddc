"""heloco_jax.outer.packing: a tree in one buffer per dtype (docs/ALGORITHMS.md, "Packed outer
state"), checked against NumPy and against the tree it packs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import heloco_jax as hj
from heloco_jax.outer import packing

BLOCK = packing.BLOCK


def _tree(seed: int = 0) -> dict:
  """Leaves of every awkward size: a scalar, an empty leaf, exactly one row, one past it,
  a matrix across rows, and a bfloat16 leaf (a second buffer)."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  return {"scalar": normal(), "empty": jnp.zeros((0, 3)), "row": normal(BLOCK),
          "row_plus_one": normal(BLOCK + 1), "matrix": normal(37, 61),
          "half": jnp.asarray(rng.normal(size=(5, 9)), jnp.bfloat16)}


def test_pack_then_unpack_is_the_tree_and_the_padding_is_zero():
  tree = _tree()
  packed = packing.pack(tree)
  layout = packed.layout
  assert layout.buffer_dtypes == ("float32", "bfloat16")
  # rows: scalar 1, empty 0, row 1, row_plus_one 2, matrix ⌈2257/1024⌉ = 3 (dict keys sorted)
  names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
  rows = dict(zip(names, layout.num_rows))
  assert rows == {"['empty']": 0, "['half']": 1, "['matrix']": 3, "['row']": 1,
                  "['row_plus_one']": 2, "['scalar']": 1}
  assert [b.shape for b in packed.buffers] == [(7, BLOCK), (1, BLOCK)]
  back = packing.unpack(packed)
  assert jax.tree.structure(back) == jax.tree.structure(tree)
  for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
  used = sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(tree)
             if x.dtype == jnp.float32)
  assert float(jnp.sum(packed.buffers[0] != 0)) == used  # N(0, 1) values are never 0
  # equal layouts for the same structure, shapes and dtypes (jit caches hit), even once
  # layout_of's cache has dropped the first object
  assert packing.pack(_tree(1)).layout is layout
  packing.layout_of.cache_clear()
  again = packing.pack(_tree(1))
  assert again.layout is not layout and again.layout == layout
  assert jax.tree.structure(again) == jax.tree.structure(packed)
  assert packing.pack({"other": jnp.zeros(3)}).layout != layout


def test_leaf_sums_are_numpys_per_leaf_dot_products():
  d, m = _tree(2), _tree(3)
  sums = np.asarray(packing.leaf_sums(packing.pack(d), packing.pack(m),
                                      lambda x: x.astype(jnp.float32)))
  want = []
  for x, y in zip(jax.tree.leaves(d), jax.tree.leaves(m)):
    x, y = np.asarray(x, np.float64).ravel(), np.asarray(y, np.float64).ravel()
    want.append([x @ y, x @ x, y @ y])
  np.testing.assert_allclose(sums, np.array(want), rtol=2e-6, atol=1e-4)


def test_leaf_sums_lower_to_no_scatter():
  """A scatter (``jax.ops.segment_sum``) took 6.3 ms of the packed HeLoCo step's 7.8 on an
  H200: XLA fused the row sums into it (packing.leaf_sums' docstring)."""
  d = packing.pack(_tree(2))
  text = jax.jit(lambda a, b: packing.leaf_sums(a, b, lambda x: x)).lower(d, d).as_text()
  assert "scatter" not in text
  assert "reduce" in text  # the text is the program's: a check that can see its ops


@pytest.mark.parametrize("scope", ["leaf", "tree"])
def test_heloco_correct_on_a_packed_tree_is_the_trees(scope):
  d = {k: v.astype(jnp.float32) for k, v in _tree(4).items()}
  m = {k: v.astype(jnp.float32) for k, v in _tree(5).items()}
  d["matrix"] = -m["matrix"] + 0.1 * d["matrix"]  # a block that shrinks
  d["row"] = m["row"] + 0.1 * d["row"]  # one that is kept
  want, want_info = hj.heloco_correct(d, m, scope=scope)
  got, info = hj.heloco_correct(packing.pack(d), packing.pack(m), scope=scope)
  assert isinstance(got, packing.Packed)
  np.testing.assert_array_equal(info.branch, want_info.branch)
  if scope == "leaf":
    assert set(np.asarray(info.branch).tolist()) >= {0, 1, 2}  # pass, keep, shrink
  np.testing.assert_allclose(info.cosine, want_info.cosine, atol=1e-6)
  for x, y in zip(jax.tree.leaves(packing.unpack(got)), jax.tree.leaves(want)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_pack_like_packs_the_subtrees_its_reference_packs():
  params = {"w": jnp.ones((3, 4)), "b": jnp.zeros(2)}
  tx = hj.heloco(0.7, 0.9, num_workers=2)
  packed_state = tx.init(packing.pack(params))
  tree_state = packing.unpack_all(packed_state)
  assert jax.tree.structure(tree_state) == jax.tree.structure(tx.init(params))
  again = packing.pack_like(tree_state, packed_state)
  assert jax.tree.structure(again) == jax.tree.structure(packed_state)
  for x, y in zip(jax.tree.leaves(again), jax.tree.leaves(packed_state)):
    np.testing.assert_array_equal(x, y)
