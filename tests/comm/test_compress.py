"""heloco_jax.comm.compress against the NumPy reference of ALGORITHMS.md, "Compression of
pseudo-gradients" (``tests/numpy_reference.py``, written from that section alone).

The quantizers compute in float32 on both sides with the same operations, so codes, scales,
indices and decompressed values are compared bit for bit; error feedback is checked bit for
bit against the reference in float32 and, in float64, for its exact residual identity.
"""

from __future__ import annotations

import doctest
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from heloco_jax.comm import compress
from heloco_jax.comm import uplink as uplink_lib
from heloco_jax.training import rejection

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy_reference as ref  # noqa: E402


def make_tree(seed=0):
  """A bfloat16 scalar; a float32 matrix of 315 entries (not a multiple of 256) spanning ~10
  decades (fp8 subnormals, int codes rounding to 0); an all-zero leaf; in nested containers."""
  rng = np.random.default_rng(seed)
  wide = rng.standard_normal((7, 45)) * np.exp(3.0 * rng.standard_normal((7, 45)))
  return {
      "scalar": [jnp.asarray(rng.standard_normal(), jnp.bfloat16)],
      "dense": {"kernel": jnp.asarray(wide, jnp.float32), "bias": jnp.zeros(45, jnp.float32)},
  }


TREE = make_tree()


def leaves(tree):
  return [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]


@functools.lru_cache(maxsize=None)
def jitted(kind, error_feedback=False, **kw):
  """(compressor, step) with step(delta, state) = jit of (payload, new state, D(payload)):
  one compiled program per compressor, shared by the tests."""
  c = compress.by_name(kind, error_feedback=error_feedback, **kw)

  def step(delta, state):
    payload, state = c.compress(delta, state)
    return payload, state, c.decompress(payload)

  return c, jax.jit(step)


@functools.lru_cache(maxsize=None)
def outputs(kind, **kw):
  """(payload, decompressed) of the jitted compressor on TREE."""
  c, step = jitted(kind, **kw)
  payload, _, out = step(TREE, c.init(TREE))
  return payload, out


def ref_roundtrip(kind, x, **kw):
  """The reference's D(C(x)), rounded to x's dtype as the library's decompress does, as
  float32 values."""
  out = ref.roundtrip(kind, np.asarray(x, np.float32), **kw)
  return ref.round_bfloat16(out) if x.dtype == jnp.bfloat16 else out


def assert_same_bits(a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert a.dtype == b.dtype and a.shape == b.shape
  np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))


CASES = [
    ("none", {}), ("bf16", {}), ("fp8", {}), ("int8", {}), ("int4", {}), ("int2", {"block": 7}),
    ("top_k", {"fraction": 0.1}),
]
CASE_IDS = [kind + "".join(f"-{k}={v}" for k, v in kw.items()) for kind, kw in CASES]


# --------------------------------------------------------------------------------------------
# the reference itself, on hand-computed values
# --------------------------------------------------------------------------------------------
def test_reference_roundings_on_known_values():
  e = 2.0 ** -9  # e4m3fn's smallest subnormal
  y = [0.0, 1.0625, 1.1875, 17.0, 19.0, 448.0, -e, e / 2, 3 * e / 2, 0.6 * e, 240.0, 250.0]
  want = [0.0, 1.0, 1.25, 16.0, 20.0, 448.0, -e, 0.0, 2 * e, e, 240.0, 256.0]
  assert ref.round_e4m3(y).tolist() == want
  x = [1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8 + 2 ** -20), 3.0]
  assert ref.round_bfloat16(x).tolist() == [1.0, 1.0, 1 + 2 ** -6, -(1 + 2 ** -7), 3.0]
  codes, scales = ref.int_compress([0.375, -0.75, 0.125, 0.0, 2.0], bits=3, block=4)
  assert codes.tolist() == [[2, -3, 0, 0], [3, 0, 0, 0]] and scales[0] == 0.25
  assert ref.top_k_count(100, 0.07) == 7 and ref.top_k_count(1000, 0.01) == 10
  assert ref.top_k_count(3, 0.01) == 1 and ref.top_k_count(0, 0.5) == 0


# --------------------------------------------------------------------------------------------
# each compressor against the reference
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, kw", CASES, ids=CASE_IDS)
def test_decompress_matches_reference_bit_for_bit(kind, kw):
  _, out = outputs(kind, **kw)
  assert jax.tree.structure(out) == jax.tree.structure(TREE)
  for x, y in zip(jax.tree.leaves(TREE), jax.tree.leaves(out)):
    assert y.dtype == x.dtype and y.shape == x.shape  # Δ's dtypes and shapes
    assert_same_bits(np.asarray(y, np.float32), ref_roundtrip(kind, x, **kw))


@pytest.mark.parametrize("kind, kw", [case for case in CASES if case[0].startswith("int")],
                         ids=[i for i in CASE_IDS if i.startswith("int")])
def test_int_codes_and_scales_match_reference(kind, kw):
  payload, _ = outputs(kind, **kw)
  bits, block = ref.INT_BITS[kind], kw.get("block", 256)
  nodes = jax.tree.leaves(payload, is_leaf=lambda p: isinstance(p, compress.Quantized))
  for x, p in zip(jax.tree.leaves(TREE), nodes):
    codes, scales = ref.int_compress(np.asarray(x, np.float32), bits, block)
    assert p.codes.dtype == jnp.int8 and p.scale.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(p.codes), codes)
    assert_same_bits(p.scale, scales)
    assert np.abs(codes).max(initial=0) <= ref.int_levels(bits)
  assert np.any(np.asarray(payload["dense"]["kernel"].codes) == 0)


def test_fp8_codes_and_scale_match_reference():
  payload, _ = outputs("fp8")
  nodes = jax.tree.leaves(payload, is_leaf=lambda p: isinstance(p, compress.Quantized))
  for x, p in zip(jax.tree.leaves(TREE), nodes):
    codes, scale = ref.fp8_compress(np.asarray(x, np.float32))
    assert p.codes.dtype == jnp.float8_e4m3fn and p.scale.shape == ()
    assert_same_bits(np.asarray(p.codes.astype(jnp.float32)), codes)
    assert_same_bits(p.scale, np.asarray(scale))
  kernel = np.asarray(payload["dense"]["kernel"].codes.astype(jnp.float32))
  assert np.any((kernel != 0) & (np.abs(kernel) < 2.0 ** -6)), "no subnormal code was exercised"


def test_top_k_indices_and_values_match_reference():
  fraction = 0.1  # k = 32 of the 315 kernel entries, 5 of the 45 zeros, 1 of the scalar
  payload, _ = outputs("top_k", fraction=fraction)
  nodes = jax.tree.leaves(payload, is_leaf=lambda p: isinstance(p, compress.Sparse))
  for x, p in zip(jax.tree.leaves(TREE), nodes):
    values, indices = ref.top_k_compress(np.asarray(x, np.float32), fraction)
    assert p.indices.dtype == jnp.int32 and p.values.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(p.indices), indices)
    assert_same_bits(p.values, values)
  # The all-zero leaf keeps its first k entries (ties: the lower index first).
  k = ref.top_k_count(45, fraction)
  assert payload["dense"]["bias"].indices.tolist() == list(range(k))


def test_top_k_breaks_ties_by_index():
  c = compress.top_k(0.5)
  payload, _ = jax.jit(c.compress)({"w": jnp.array([1.0, -1.0, 1.0, -1.0, 0.5])}, None)
  assert payload["w"].indices.tolist() == [0, 1, 2]
  assert payload["w"].values.tolist() == [1.0, -1.0, 1.0]


def test_quantization_errors_are_within_their_bounds():
  """Float64 checks of the formulas' promises, independent of bit equality."""
  x = np.asarray(TREE["dense"]["kernel"], np.float64).ravel()  # 315 entries
  for kind, kw in CASES:
    if kind in ref.INT_BITS:
      block = kw.get("block", 256)
      _, out = outputs(kind, **kw)
      err = np.abs(np.asarray(out["dense"]["kernel"], np.float64).ravel() - x)
      padded = np.concatenate([x, np.zeros(-x.size % block)]).reshape(-1, block)
      half_step = 0.5 * np.abs(padded).max(axis=1) / ref.int_levels(ref.INT_BITS[kind])
      assert np.all(err <= np.repeat(half_step, block)[:x.size] * (1 + 1e-6))
  _, out = outputs("fp8")
  err = np.abs(np.asarray(out["dense"]["kernel"], np.float64).ravel() - x)
  subnormal_step = np.abs(x).max() / 448 * 2.0 ** -9
  assert np.all(err <= np.maximum(np.abs(x) / 16, subnormal_step / 2) * (1 + 1e-6))
  _, out = outputs("top_k", fraction=0.1)
  kept = np.asarray(out["dense"]["kernel"], np.float64).ravel() != 0
  assert kept.sum() == 32 and np.abs(x[kept]).min() >= np.abs(x[~kept]).max()


# --------------------------------------------------------------------------------------------
# bytes on the wire
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("compressor, shapes, want", [
    (compress.none(), [(1000,)], 4000),
    (compress.bf16(), [(1000,)], 2000),
    (compress.fp8(), [(1000,)], 1004),
    (compress.int8(block=256), [(1000,)], 1000 + 4 * 4),
    (compress.int4(block=256), [(1000,)], 500 + 16),
    (compress.int2(block=256), [(1000,)], 250 + 16),
    (compress.int4(block=256), [(5,)], 3 + 4),
    (compress.int_quantize(3, block=4), [(5,)], 2 + 8),
    (compress.int8(block=10), [(), (3,), (4, 5)], (1 + 4) + (3 + 4) + (20 + 8)),
    (compress.fp8(), [(), (2, 2)], 5 + 8),
    (compress.top_k(0.01), [(1000,)], 80),
    (compress.top_k(0.07), [(100,)], 56),
    (compress.top_k(0.01), [(), (3,)], 16),
    (compress.error_feedback(compress.int8()), [(1000,)], 1016),
], ids=["none", "bf16", "fp8", "int8", "int4", "int2", "int4-5", "int3-5", "int8-mixed",
        "fp8-mixed", "top_k", "top_k-0.07", "top_k-small", "ef-int8"])
def test_nbytes_of_known_shapes(compressor, shapes, want):
  delta = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
  payload, _ = jax.eval_shape(compressor.compress, delta, compressor.init(delta))
  got = compressor.nbytes(payload)
  assert type(got) is int and got == want


@pytest.mark.parametrize("kind, kw", CASES, ids=CASE_IDS)
def test_nbytes_matches_reference(kind, kw):
  c, _ = jitted(kind, **kw)
  want = sum(ref.compressed_nbytes(kind, x.shape, x.dtype.itemsize, **kw)
             for x in jax.tree.leaves(TREE))
  payload, _ = outputs(kind, **kw)
  got = c.nbytes(payload)
  assert type(got) is int and got == want
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), TREE)
  assert c.nbytes(jax.eval_shape(c.compress, abstract, c.init(abstract))[0]) == want


# --------------------------------------------------------------------------------------------
# jit
# --------------------------------------------------------------------------------------------
def assert_jit_equals_eager(c, step, delta, state):
  """Returns the eager state after checking that jit(compress, decompress) gives its bits."""
  payload, new_state = c.compress(delta, state)
  eager = (payload, new_state, c.decompress(payload))
  jit = step(delta, state)
  assert jax.tree.structure(eager) == jax.tree.structure(jit)
  for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jit)):
    assert_same_bits(a, b)
  return new_state


@pytest.mark.parametrize("kind, kw", CASES, ids=CASE_IDS)
def test_jit_gives_the_same_bits_as_eager(kind, kw):
  c, step = jitted(kind, **kw)
  assert_jit_equals_eager(c, step, TREE, c.init(TREE))


EF_CASES = [("fp8", {}), ("int2", {"block": 7}), ("top_k", {"fraction": 0.1})]
EF_IDS = [kind for kind, _ in EF_CASES]


@pytest.mark.parametrize("kind, kw", EF_CASES, ids=EF_IDS)
def test_jit_gives_the_same_bits_as_eager_with_error_feedback(kind, kw):
  """Also the residual: XLA must not fuse the product code·s into e = v − D(p) (an FMA)."""
  c, step = jitted(kind, True, **kw)
  state = c.init(TREE)
  for delta in (TREE, jax.tree.map(lambda x: -x, TREE)):  # the second from a nonzero residual
    state = assert_jit_equals_eager(c, step, delta, state)


# --------------------------------------------------------------------------------------------
# error feedback
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, kw", EF_CASES, ids=EF_IDS)
def test_error_feedback_matches_reference_and_keeps_the_residual_identity(kind, kw):
  deltas = [jax.tree.map(lambda x, i=t: x * (1.0 + 0.25 * i), TREE) for t in range(4)]
  for t in range(4):  # vary the all-zero leaf and the sign pattern too
    deltas[t]["dense"]["bias"] = jnp.asarray(np.random.default_rng(t).standard_normal(45),
                                             jnp.float32) * (t % 2)
    deltas[t]["dense"]["kernel"] = deltas[t]["dense"]["kernel"] * (-1) ** t
  c, step = jitted(kind, True, **kw)
  state = c.init(TREE)
  ref_leaves = [leaves(d) for d in deltas]
  leaf_roundtrip = lambda v: ref.roundtrip(kind, v, **kw)
  v32, sent32, res32 = ref.error_feedback(leaf_roundtrip, ref_leaves, np.float32)
  for t, delta in enumerate(deltas):
    corrected = [d + np.asarray(e) for d, e in zip(ref_leaves[t], jax.tree.leaves(state.residual))]
    _, state, out = step(delta, state)
    sent, residual = leaves(out), leaves(state.residual)
    for i in range(len(sent)):
      assert_same_bits(sent[i], sent32[t][i])
      assert_same_bits(residual[i], res32[t][i])
      # D(p_t) + e_t = Δ_t + e_{t−1}, up to the one rounding of e_t = v − D(p_t).
      v = corrected[i].astype(np.float64)
      back = sent[i].astype(np.float64) + residual[i].astype(np.float64)
      assert np.all(np.abs(back - v) <= np.abs(v) * 2.0 ** -24)
  assert sum(float(np.abs(e).sum()) for e in res32[-1]) > 0
  # In float64 the identity is exact (the subtraction of two close numbers is exact).
  v64, sent64, res64 = ref.error_feedback(leaf_roundtrip, ref_leaves, np.float64)
  for t in range(len(deltas)):
    for v, d, e in zip(v64[t], sent64[t], res64[t]):
      np.testing.assert_array_equal(d + e, v)


@pytest.mark.parametrize("kind, kw", EF_CASES[1:], ids=EF_IDS[1:])
def test_error_feedback_keeps_the_running_sum_on_track(kind, kw):
  """Σ D(p_t) = Σ Δ_t − e_T with error feedback (off by one step's compression error);
  without it the same biased compression error adds up at every step."""
  steps = 40
  rng = np.random.default_rng(20)
  deltas = [jax.tree.map(lambda x: x * (1 + 0.01 * rng.standard_normal(x.shape)).astype(x.dtype),
                         TREE) for _ in range(steps)]
  total = np.cumsum([np.concatenate([np.ravel(x) for x in leaves(d)]) for d in deltas], axis=0,
                    dtype=np.float64)
  errors = {}
  for ef in (True, False):
    c, step = jitted(kind, ef, **kw)
    state = c.init(TREE)
    sent = np.zeros(total.shape[1])
    errors[ef] = []
    for t, delta in enumerate(deltas):
      previous = state
      _, state, out = step(delta, state)
      sent += np.concatenate([np.ravel(x) for x in leaves(out)])
      errors[ef].append(np.abs(sent - total[t]).max())
    if ef:
      residual = np.concatenate([np.ravel(x) for x in leaves(state.residual)])
      np.testing.assert_allclose(sent - total[-1], -residual, rtol=0,
                                 atol=1e-5 * np.abs(total[-1]).max())
      # e_T = v_T − D(C(v_T)): one step's compression error, on v_T = Δ_T + e_{T−1}.
      for x, e, e_last in zip(leaves(deltas[-1]), jax.tree.leaves(previous.residual),
                              jax.tree.leaves(state.residual)):
        v = x + np.asarray(e)
        np.testing.assert_array_equal(np.asarray(e_last), v - ref.roundtrip(kind, v, **kw))
  with_ef, without_ef = np.array(errors[True]), np.array(errors[False])
  half = steps // 2
  assert with_ef[half:].max() <= 1.5 * with_ef[:half].max()  # bounded
  assert without_ef[-1] >= 0.5 * steps * without_ef[0]         # grows linearly
  assert without_ef[-1] > 5 * with_ef[-1]


def test_error_feedback_state_is_float32_and_shaped_like_params():
  c, step = jitted("int2", True, block=7)
  state = c.init(TREE)
  assert isinstance(state, compress.ErrorFeedbackState)
  assert [(e.shape, e.dtype) for e in jax.tree.leaves(state.residual)] == [
      (x.shape, jnp.float32) for x in jax.tree.leaves(TREE)]
  assert all(not np.any(np.asarray(e)) for e in jax.tree.leaves(state.residual))
  _, state, out = step(TREE, state)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(out))
  assert all(e.dtype == jnp.float32 for e in jax.tree.leaves(state.residual))


# --------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make, message", [
    (lambda: compress.by_name("int3"),
     "by_name: kind='int3' is not allowed; allowed: one of 'none', 'bf16', 'fp8', 'int8', "
     "'int4', 'int2', 'top_k'."),
    (lambda: compress.by_name("int8", block=0),
     "by_name: block=0 is not allowed; allowed: an integer >= 1."),
    (lambda: compress.by_name("int8", block=2.5),
     "by_name: block=2.5 is not allowed; allowed: an integer >= 1."),
    (lambda: compress.by_name("top_k", fraction=0.0),
     "by_name: fraction=0.0 is not allowed; allowed: a number in (0, 1]."),
    (lambda: compress.by_name("top_k", fraction=1.5),
     "by_name: fraction=1.5 is not allowed; allowed: a number in (0, 1]."),
    (lambda: compress.by_name("int8", error_feedback="yes"),
     "by_name: error_feedback='yes' is not allowed; allowed: True or False."),
    (lambda: compress.int_quantize(1),
     "int_quantize: bits=1 is not allowed; allowed: an integer in [2, 8]."),
    (lambda: compress.int_quantize(9),
     "int_quantize: bits=9 is not allowed; allowed: an integer in [2, 8]."),
    (lambda: compress.int_quantize(4.0),
     "int_quantize: bits=4.0 is not allowed; allowed: an integer in [2, 8]."),
    (lambda: compress.int_quantize(4, block=True),
     "int_quantize: block=True is not allowed; allowed: an integer >= 1."),
    (lambda: compress.int8(block=0),
     "int8: block=0 is not allowed; allowed: an integer >= 1."),
    (lambda: compress.int4(block=-1),
     "int4: block=-1 is not allowed; allowed: an integer >= 1."),
    (lambda: compress.int2(block="8"),
     "int2: block='8' is not allowed; allowed: an integer >= 1."),
    (lambda: compress.top_k(0),
     "top_k: fraction=0 is not allowed; allowed: a number in (0, 1]."),
    (lambda: compress.top_k(float("nan")),
     "top_k: fraction=nan is not allowed; allowed: a number in (0, 1]."),
    (lambda: compress.error_feedback("int8"),
     "error_feedback: compressor='int8' is not allowed; allowed: a Compressor, e.g. "
     "heloco_jax.comm.compress.int8()."),
    (lambda: compress.int8().compress({"w": jnp.ones(3, jnp.int32)}, None),
     "int8: a leaf of dtype int32 is not allowed; allowed: a floating dtype (the compressors "
     "take trees of float arrays)."),
])
def test_bad_arguments_raise_one_line_errors(make, message):
  with pytest.raises(ValueError) as info:
    make()
  assert str(info.value) == message and "\n" not in message


def test_module_examples_pass():
  result = doctest.testmod(compress, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                           verbose=False)
  assert result.attempted > 0
  assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"
  for name in ("none", "bf16", "fp8", "int_quantize", "int8", "int4", "int2", "top_k",
               "error_feedback", "by_name"):
    doc = getattr(compress, name).__doc__
    assert "\n  Examples:\n" in doc and ">>> " in doc, name


# ---------------------------------------------------------------------------------------------
# in a run (ALGORITHMS.md, "Compression in a run"): the engine's uplink, bytes and clock
# ---------------------------------------------------------------------------------------------
import heloco_jax as hj  # noqa: E402
from heloco_jax.comm import fragments  # noqa: E402

ASYNC_METHODS = ("async_nesterov", "delayed_nesterov", "mla", "heloco")
ROUND_METHODS = ("local_sgd", "diloco", "palsgd")


def _loss(params, batch):
  x, y = batch
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _stream(worker):
  rng = np.random.default_rng(worker)
  while True:
    x = rng.normal(size=(16, 8)).astype(np.float32)
    yield x, (x @ np.arange(1.0, 9.0, dtype=np.float32)[:, None] + worker)


PARAMS = {"w": jnp.zeros((8, 1)), "b": jnp.zeros((1,))}
EVAL_BATCH = next(_stream(7))


def _run(method, compressor=None, **options):
  options = {"inner_steps": 4, "budget": hj.Budget(steps=240, eval_every_steps=60),
             "speeds": [1.0, 2.0, 3.0], **options}
  if method == "palsgd":
    options["inner_tx"] = hj.palsgd_inner(optax.identity(), 0.05)
  return hj.simulate(_loss, PARAMS, [_stream(i) for i in range(3)], method=method,
                     eval_fn=lambda p: _loss(p, EVAL_BATCH), compress=compressor, **options)


@pytest.mark.parametrize("method", ASYNC_METHODS)
def test_compress_none_is_the_uncompressed_run_bit_for_bit(method):
  plain, none = _run(method), _run(method, compress.none())
  assert [r for r in none.history] == plain.history
  assert jax.tree.map(np.array_equal, none.params, plain.params) == {"w": True, "b": True}


@pytest.mark.parametrize("method", ROUND_METHODS)
def test_compress_none_in_rounds_averages_the_workers_deltas(method):
  """Rounds average θ − end_i per worker with a compressor (θ − mean end_i without one): the
  same up to float rounding."""
  plain, none = _run(method), _run(method, compress.none())
  np.testing.assert_allclose(none.params["w"], plain.params["w"], rtol=1e-5, atol=1e-6)
  assert [r["event"] for r in none.history] == [r["event"] for r in plain.history]


def test_a_round_of_compressed_deltas_against_numpy():
  """``Uplink.round_delta``: the mean of the accepted workers' D(C(θ − end_i)) with error
  feedback's first residuals e_i = Δ_i − D(C(Δ_i)); the NaN worker is rejected and keeps its
  state (ALGORITHMS.md, "Compression in a run")."""
  rng = np.random.default_rng(3)
  params = {"a": jnp.asarray(rng.standard_normal((5, 60)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal(7), jnp.float32)}
  ends = jax.tree.map(lambda p: p[None] - jnp.asarray(
      rng.standard_normal((3, *p.shape)), jnp.float32), params)
  ends["b"] = ends["b"].at[1, 0].set(jnp.nan)
  accepted = np.array([True, False, True])
  uplink = uplink_lib.Uplink(compress.error_feedback(compress.int4(block=16)), params,
                            fragments.split(params, 1))
  [states] = uplink.init(params, 3, stacked=True)  # one fragment: θ
  delta, states = uplink.round_delta(params, ends, accepted, states)
  for name in params:
    deltas = np.asarray(params[name])[None] - np.asarray(ends[name])
    sent = {i: ref.int_roundtrip(deltas[i], 4, 16) for i in (0, 2)}
    # the mean rounds once more under jit (XLA may fuse D(p)·½ + ...): a few ulps
    np.testing.assert_allclose(delta[name], (sent[0] + sent[2]) / 2, rtol=1e-5, atol=1e-7)
    for i in (0, 2):
      np.testing.assert_array_equal(states.residual[name][i], deltas[i] - sent[i])
    np.testing.assert_array_equal(states.residual[name][1], 0.0)


@pytest.mark.parametrize("compressor", [compress.error_feedback(compress.int8()),
                                        compress.error_feedback(compress.top_k(0.1))],
                         ids=["int8", "top_k"])
def test_a_non_finite_delta_reaches_the_server_and_keeps_the_residual(compressor):
  """top_k alone would send only finite entries of a Δ holding NaN, and the residual would
  hold NaN for ever: ``transmit`` sends such a Δ as it is (the server rejects it) and keeps
  the worker's state."""
  delta = {"w": jnp.arange(1.0, 41.0).at[3].set(jnp.nan)}
  state = compressor.init(delta)
  state = compressor.compress({"w": jnp.full(40, 0.3)}, state)[1]
  received, kept = compress.transmit(compressor, delta, state)
  assert np.isnan(received["w"][3])
  np.testing.assert_array_equal(kept.residual["w"], state.residual["w"])


@pytest.mark.parametrize("kind, kw", EF_CASES, ids=EF_IDS)
def test_send_then_receive_in_two_programs_is_transmit_bit_for_bit(kind, kw):
  """runtime=devices compresses on the worker's devices and decompresses on the server's
  (``send``, then ``receive`` of the message alone): the same bits as ``transmit``'s one
  program, the received Δ and the worker's next state alike, three steps running."""
  compressor = compress.by_name(kind, error_feedback=True, **kw)
  like = jax.eval_shape(lambda t: t, TREE)
  send = jax.jit(functools.partial(compress.send, compressor))
  receive = jax.jit(functools.partial(compress.receive, compressor, like=like))
  transmit = jax.jit(functools.partial(compress.transmit, compressor))
  fused = split = compressor.init(TREE)
  for step in range(3):
    delta = jax.tree.map(lambda x, step=step: x * (step + 1.5), TREE)
    received, fused = transmit(delta, fused)
    message, split = send(delta, split)
    jax.tree.map(assert_same_bits, receive(message), received)
    jax.tree.map(assert_same_bits, split, fused)


@pytest.mark.parametrize("bad, reason", [(jnp.nan, "nan"), (jnp.inf, "inf")])
def test_a_non_finite_delta_sent_apart_is_rejected_for_the_same_reason(bad, reason):
  """Sent apart, a Δ holding NaN (Inf) is received as NaN (Inf) everywhere: the server's
  rejection gives the reason the Δ itself would (``rejection.screen``); the state is kept."""
  compressor = compress.error_feedback(compress.top_k(0.1))
  delta = {"w": jnp.arange(1.0, 41.0).at[3].set(bad)}
  state = compressor.compress({"w": jnp.full(40, 0.3)}, compressor.init(delta))[1]
  message, kept = compress.send(compressor, delta, state)
  received = compress.receive(compressor, message, delta)
  assert rejection.screen([received]) == rejection.screen([delta]) == [reason]
  np.testing.assert_array_equal(kept.residual["w"], state.residual["w"])


def test_the_clock_charges_the_compressed_bytes_and_the_rows_count_them():
  """A dispatch takes latency + θ's bytes/bandwidth, H·t compute and latency + the payload's
  bytes/bandwidth; every arrival row and the summary count the bytes; ALGORITHMS.md, "Time and
  cost model"."""
  comm = hj.CommModel(latency=0.5, bandwidth=100.0)
  compressor = compress.error_feedback(compress.int8(block=4))
  result = _run("heloco", compressor, comm=comm)
  up = compress.payload_nbytes(compressor, PARAMS)
  down = compress.payload_nbytes(None, PARAMS)
  assert (up, down) == (2 * 4 + 4 * 2 + 1 + 4, 36)  # w: 2 blocks of 4 codes + 2 scales; b: 1 + 1
  arrivals = [r for r in result.history if r["event"] == "arrival"]
  assert arrivals[0]["sim_time"] == 0.5 + down / 100.0 + 4 * 1.0 + 0.5 + up / 100.0
  assert {(r["bytes_up"], r["bytes_down"]) for r in arrivals} == {(up, down)}
  summary = result.summary
  assert summary["bytes_sent"] == len(arrivals) * (up + down)
  assert summary["peak_bytes_per_sync"] == up + down
  np.testing.assert_allclose(summary["network_seconds"],
                             len(arrivals) * (1.0 + (up + down) / 100.0))
  plain = _run("heloco", comm=comm).summary  # Δ in float32: θ's bytes each way
  assert plain["bytes_sent"] == plain["outer_updates"] * 2 * down
  np.testing.assert_allclose(plain["network_seconds"],
                             plain["outer_updates"] * (1.0 + 2 * down / 100.0))


def test_a_compressed_round_all_reduces_every_workers_payload():
  comm = hj.CommModel(latency=0.25, bandwidth=50.0)
  compressor = compress.bf16()
  result = _run("diloco", compressor, comm=comm)
  up = compress.payload_nbytes(compressor, PARAMS)
  assert up == 2 * 9
  rounds = [r for r in result.history if r["event"] == "train"]
  assert {(r["bytes_up"], r["bytes_down"]) for r in rounds} == {(3 * up, 3 * up)}
  allreduce = 0.25 + 2 * 2 / 3 * up / 50.0
  assert rounds[0]["sim_time"] == 4 * 3.0 + allreduce  # the slowest worker, then the all-reduce
  assert result.summary["peak_bytes_per_sync"] == 6 * up
  np.testing.assert_allclose(result.summary["network_seconds"], len(rounds) * 3 * allreduce)


def test_compression_is_refused_where_it_cannot_run_in_one_line():
  with pytest.raises(ValueError, match=r"^compress='int8' is not allowed; allowed: None"):
    _run("heloco", "int8")
  with pytest.raises(ValueError, match=r"^compression is not allowed with method='ddp'"):
    _run("ddp", compress.int8())
