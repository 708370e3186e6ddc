"""Compression of pseudo-gradients (ALGORITHMS.md, "Compression of pseudo-gradients").

A ``Compressor`` is four pure functions, in the optax style:

  init(params) -> state                        per-worker state (e.g. error feedback's residual)
  compress(delta, state) -> (payload, state)   on the worker, before sending Δ
  decompress(payload) -> delta                 on the server: a float tree like Δ
  nbytes(payload) -> int                       bytes on the wire (from shapes and dtypes only)

Every compressor works leaf by leaf on any pytree of float arrays, under ``jit``:

  none()             Δ as it is                          itemsize bytes per entry
  bf16()             bfloat16(Δ)                         2 bytes per entry
  fp8()              s = max|x|/448, e4m3(x/s)           1 byte per entry + 4 per leaf
  int8/int4/int2()   per block of B: s_b = max|x|/L,     bits/8 per entry + 4 per block
                     clip(round(x/s_b), −L, L)
  top_k(f)           the ⌈f·n⌉ entries of largest |x|    8 bytes per kept entry

``error_feedback(c)`` wraps any of them so that what a compression drops is
sent later: p_t = C(Δ_t + e_{t−1}), e_t = Δ_t + e_{t−1} − D(p_t), e_0 = 0.
``by_name(kind, ...)`` builds one from the run config's keys.

Scales and codes divide in float32, correctly rounded on CPUs. On NVIDIA GPUs XLA divides
with PTX's ``div.full`` (within 2 ulp, openxla/xla#37181): a scale can be one ulp off and a
code one step off at a tie, unless ``XLA_FLAGS`` holds
``--xla_backend_extra_options=-nvptx-prec-divf32=2`` (IEEE division; ``tests/conftest.py``
sets it, so that the NumPy reference's bits hold on a GPU too).
"""

from __future__ import annotations

import dataclasses
import fractions
import functools
import math
import numbers
from typing import Any, Callable, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import numpy as np
import optax

from heloco_jax.outer import _validation

Kind = Literal["none", "bf16", "fp8", "int8", "int4", "int2", "top_k"]
KINDS: tuple[str, ...] = get_args(Kind)

E4M3_MAX = 448.0  # the largest finite float8 e4m3fn


class Compressor(NamedTuple):
  """A pseudo-gradient compressor: four pure, jit-able functions.

  Attributes:
    init: ``init(params) -> state``, the per-worker state (``optax.EmptyState()``
      for the stateless compressors; error feedback's residual).
    compress: ``compress(delta, state) -> (payload, state)``, run by the
      worker before it sends Δ.
    decompress: ``decompress(payload) -> delta``, run by the server: a tree of
      float arrays with Δ's structure, shapes and dtypes.
    nbytes: ``nbytes(payload) -> int``, the bytes the payload occupies on the
      wire: a Python int computed from shapes and dtypes alone (no device
      work), so it also takes the ``jax.ShapeDtypeStruct`` tree that
      ``jax.eval_shape(compress, ...)`` returns.
  """
  init: Callable[[Any], Any]
  compress: Callable[[Any, Any], tuple[Any, Any]]
  decompress: Callable[[Any], Any]
  nbytes: Callable[[Any], int]


@dataclasses.dataclass(frozen=True)
class Compression:
  """What crosses the wire compressed (``hj.simulate(..., compress=...)``; a ``Compressor``
  alone is ``up``).

  Attributes:
    up: the workers' pseudo-gradients (ALGORITHMS.md, "Compression in a run"); None: as
      they are.
    down: θ's downloads, as C(θ_d − x̂) with x̂ what the worker last started from
      (ALGORITHMS.md, "Compressed downloads"; asynchronous methods); None: as it is.
  """
  up: Compressor | None = None
  down: Compressor | None = None


@dataclasses.dataclass(frozen=True)
class LeafSpec:
  """Shape and dtype of one leaf of Δ, kept in its payload as static data (no arrays).

  Registered with JAX as static (a pytree node with no leaves), so it costs
  nothing under ``jit`` and lets ``decompress`` rebuild the leaf from the
  payload alone.
  """
  shape: tuple[int, ...]
  dtype: Any

  @property
  def size(self) -> int:
    return math.prod(self.shape)


jax.tree_util.register_static(LeafSpec)


class Cast(NamedTuple):
  """One leaf sent in a narrower float dtype (``bf16``)."""
  values: jax.Array
  spec: LeafSpec


class Quantized(NamedTuple):
  """One leaf sent as scaled codes (``fp8``: one scale; ``int_quantize``: one per block).

  Attributes:
    codes: ``fp8``: float8_e4m3fn, the leaf's shape; ``int_quantize``: int8
      of shape (number of blocks, block), the flat leaf zero-padded.
    scale: float32, shape () for ``fp8``, (number of blocks,) for ``int_quantize``.
    spec: the leaf's shape and dtype.
  """
  codes: jax.Array
  scale: jax.Array
  spec: LeafSpec


class Sparse(NamedTuple):
  """One leaf sent as its k kept entries (``top_k``): float32 values and int32 flat indices."""
  values: jax.Array
  indices: jax.Array
  spec: LeafSpec


class ErrorFeedbackState(NamedTuple):
  """State of ``error_feedback``.

  Attributes:
    residual: e, what the compression has not sent yet: a tree like the
      parameters, in at least float32 (starts at 0).
    inner: the wrapped compressor's state.
  """
  residual: Any
  inner: Any


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def _fail(fn: str, name: str, value: Any, allowed: str) -> None:
  """One-line ValueError in the format of ``heloco_jax.outer._validation``."""
  raise ValueError(f"{fn}: {name}={value!r} is not allowed; allowed: {allowed}.")


def _shape_dtype(x: Any) -> tuple[tuple[int, ...], np.dtype]:
  """Shape and dtype of an array, a ``jax.ShapeDtypeStruct`` or a Python scalar."""
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return tuple(x.shape), np.dtype(x.dtype)
  return tuple(np.shape(x)), np.dtype(jax.dtypes.canonicalize_dtype(jnp.result_type(x)))


def _spec(fn: str, x: Any) -> LeafSpec:
  shape, dtype = _shape_dtype(x)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{fn}: a leaf of dtype {dtype} is not allowed; allowed: a floating "
                     "dtype (the compressors take trees of float arrays).")
  return LeafSpec(shape, dtype)


def _nbytes(x: Any) -> int:
  shape, dtype = _shape_dtype(x)
  return math.prod(shape) * dtype.itemsize


def _per_leaf(compress_leaf: Callable[[Any], Any], decompress_leaf: Callable[[Any], jax.Array],
              leaf_nbytes: Callable[[Any], int], node: type) -> Compressor:
  """A stateless compressor applying ``compress_leaf`` to every leaf of Δ.

  The per-leaf functions are module-level ``jax.jit``s (inlined under an outer
  ``jit``): an eager call compiles one program per leaf shape and options that
  change shapes, shared by every compressor, rather than one per operation.
  """
  is_node = lambda x: isinstance(x, node)

  def init_fn(params):
    del params
    return optax.EmptyState()

  def compress_fn(delta, state):
    return jax.tree.map(compress_leaf, delta), state

  def decompress_fn(payload):
    return jax.tree.map(decompress_leaf, payload, is_leaf=is_node)

  def nbytes_fn(payload):
    return sum(leaf_nbytes(p) for p in jax.tree.leaves(payload, is_leaf=is_node))

  return Compressor(init_fn, compress_fn, decompress_fn, nbytes_fn)


def _divide(x: jax.Array, y: Any) -> jax.Array:
  """x / y, correctly rounded, with and without ``jit``.

  XLA turns a division by a constant or by a broadcast into a multiplication
  by the rounded reciprocal, one ulp off x / y; a divisor behind an
  optimization barrier is neither (the barrier costs nothing once compiled).
  """
  return x / jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(y, x.dtype), x.shape))


def _as_sent(x: jax.Array) -> jax.Array:
  """x, narrow codes as they are sent: compressed and decompressed in one ``jit``, XLA may
  drop a round trip float32 → bfloat16/float8 → float32 and keep the float32 values (seen on
  an H200, jax 0.11.2: bf16 then sent Δ unrounded); behind a barrier the rounding stays."""
  return jax.lax.optimization_barrier(x)


def _unfused(x: jax.Array) -> jax.Array:
  """x, as a select that XLA cannot fold: e = v − D(p) must subtract the rounded D(p) the
  server gets, and XLA would otherwise contract the product that ends ``decompress``
  (code·s) and the subtraction into one FMA (so ``jit`` would differ from eager)."""
  return jnp.where(x == 0, jnp.zeros_like(x), x)


MAX_BLOCK = 1 << 20  # entries per scale; a larger block pads every leaf to it (memory)


def _check_block(fn: str, block: Any) -> None:
  _validation.check_positive_int(fn, "block", block, allow_none=False)
  if block > MAX_BLOCK:
    raise ValueError(f"{fn}: block={block!r} is not allowed; allowed: an integer in [1, "
                     f"{MAX_BLOCK}] (every leaf is padded to a multiple of it)")


def top_k_count(size: int, fraction: float) -> int:
  """k = max(1, ⌈f·n⌉) (at most n), with f·n computed exactly from f's shortest decimal
  form, so that 0.07 of 100 entries is 7 (the float product 7.000000000000001 is not 8)."""
  exact = fractions.Fraction(repr(float(fraction))) * size
  return min(size, max(1, math.ceil(exact)))


# --------------------------------------------------------------------------------------------
# compressors
# --------------------------------------------------------------------------------------------
def none() -> Compressor:
  """The identity: Δ is sent as it is.

  Returns:
    A ``Compressor`` whose payload is Δ itself; ``nbytes`` is the sum of the
    leaves' bytes (4 per float32 entry).

  Examples:
    >>> import jax.numpy as jnp
    >>> from heloco_jax import compress
    >>> c = compress.none()
    >>> delta = {"w": jnp.ones((10, 100))}
    >>> payload, state = c.compress(delta, c.init(delta))
    >>> c.nbytes(payload), c.decompress(payload) is delta
    (4000, True)
  """
  def init_fn(params):
    del params
    return optax.EmptyState()

  def compress_fn(delta, state):
    return delta, state

  def nbytes_fn(payload):
    return sum(_nbytes(x) for x in jax.tree.leaves(payload))

  return Compressor(init_fn, compress_fn, lambda payload: payload, nbytes_fn)


def bf16() -> Compressor:
  """Sends Δ in bfloat16 (round to nearest, ties to even).

  Returns:
    A ``Compressor``: 2 bytes per entry; ``decompress`` casts back to Δ's dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> from heloco_jax import compress
    >>> c = compress.bf16()
    >>> delta = {"w": jnp.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8])}
    >>> payload, _ = c.compress(delta, c.init(delta))
    >>> c.decompress(payload)["w"].tolist()  # 8 bits of mantissa; ties to even
    [1.0, 1.0, 1.015625]
    >>> c.nbytes(payload), str(c.decompress(payload)["w"].dtype)
    (6, 'float32')
  """
  return _per_leaf(_bf16_leaf, _cast_back, lambda p: _nbytes(p.values), Cast)


@jax.jit
def _bf16_leaf(x: jax.Array) -> Cast:
  # ALGORITHMS.md, "Compression of pseudo-gradients": D(C(x)) = bf16(x).
  return Cast(_as_sent(jnp.asarray(x).astype(jnp.bfloat16)), _spec("bf16", x))


@jax.jit
def _cast_back(p: Cast) -> jax.Array:
  return p.values.astype(p.spec.dtype)


def fp8() -> Compressor:
  """Per-leaf scaled float8 e4m3: s = max|x| / 448 (1 for an all-zero leaf), codes e4m3(x/s).

  Returns:
    A ``Compressor``: 1 byte per entry plus a float32 scale (4 bytes) per leaf;
    ``decompress`` gives float32(code)·s in Δ's dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> from heloco_jax import compress
    >>> c = compress.fp8()
    >>> delta = {"w": jnp.array([0.0, 0.3, -1.0, 4.48])}   # s = 4.48 / 448 = 0.01
    >>> payload, _ = c.compress(delta, c.init(delta))
    >>> payload["w"].codes.astype(jnp.float32).tolist()    # x/s = 0, 30, -100, 448 in e4m3
    [0.0, 30.0, -96.0, 448.0]
    >>> c.nbytes(payload)
    8
  """
  leaf_nbytes = lambda p: _nbytes(p.codes) + _nbytes(p.scale)
  return _per_leaf(_fp8_leaf, _fp8_back, leaf_nbytes, Quantized)


@jax.jit
def _fp8_leaf(x: jax.Array) -> Quantized:
  # ALGORITHMS.md, "Compression of pseudo-gradients": fp8.
  spec = _spec("fp8", x)
  x = jnp.asarray(x, jnp.float32)
  amax = jnp.max(jnp.abs(x), initial=0.0)
  scale = jnp.where(amax == 0, jnp.float32(1.0), _divide(amax, E4M3_MAX))
  # |x/s| <= 448 up to one rounding; the clip keeps e4m3fn's NaN out of reach.
  codes = jnp.clip(_divide(x, scale), -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
  return Quantized(_as_sent(codes), scale, spec)


@jax.jit
def _fp8_back(p: Quantized) -> jax.Array:
  return (p.codes.astype(jnp.float32) * p.scale).astype(p.spec.dtype)


def _int_quantize(fn: str, bits: Any, block: Any) -> Compressor:
  if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or not 2 <= bits <= 8:
    _fail(fn, "bits", bits, "an integer in [2, 8]")
  _check_block(fn, block)
  bits, block = int(bits), int(block)
  levels = 2 ** (bits - 1) - 1  # L: codes in [−L, L], symmetric around 0
  # L is an argument, not a constant: int8, int4 and int2 share one program per leaf shape.
  compress_leaf = lambda x: _int_leaf(x, jnp.float32(levels), fn=fn, block=block)
  # Packed: ⌈n·bits/8⌉ bytes of codes (the int8 array in memory is not what is sent).
  leaf_nbytes = lambda p: -(-p.spec.size * bits // 8) + _nbytes(p.scale)
  return _per_leaf(compress_leaf, _int_back, leaf_nbytes, Quantized)


@functools.partial(jax.jit, static_argnames=("fn", "block"))
def _int_leaf(x: jax.Array, levels: jax.Array, *, fn: str, block: int) -> Quantized:
  # ALGORITHMS.md, "Compression of pseudo-gradients": per-block integer quantization.
  spec = _spec(fn, x)
  num_blocks = -(-spec.size // block)
  flat = jnp.ravel(jnp.asarray(x, jnp.float32))
  blocks = jnp.pad(flat, (0, num_blocks * block - spec.size)).reshape(num_blocks, block)
  amax = jnp.max(jnp.abs(blocks), axis=1, initial=0.0)
  scale = jnp.where(amax == 0, jnp.float32(1.0), _divide(amax, levels))
  codes = jnp.clip(jnp.round(_divide(blocks, scale[:, None])), -levels, levels)  # ties to even
  return Quantized(codes.astype(jnp.int8), scale, spec)


@jax.jit
def _int_back(p: Quantized) -> jax.Array:
  values = (p.codes.astype(jnp.float32) * p.scale[:, None]).reshape(-1)[:p.spec.size]
  return values.reshape(p.spec.shape).astype(p.spec.dtype)


def int_quantize(bits: int, *, block: int = 256) -> Compressor:
  """Per-block symmetric integer quantization with ``bits`` bits.

  Each leaf is flattened and zero-padded to a multiple of ``block``; each block
  b gets the scale s_b = max|x| / L, L = 2^(bits−1) − 1 (s_b = 1 for an
  all-zero block), and each entry the code clip(round(x/s_b), −L, L), rounded
  half to even. The server gets code·s_b.

  Args:
    bits: bits per code, an integer in [2, 8].
    block: entries per scale, an integer >= 1 (default 256).

  Returns:
    A ``Compressor``: ⌈n·bits/8⌉ bytes of packed codes plus 4 bytes (a float32
    scale) per block, for a leaf of n entries. The payload holds the codes
    unpacked, as int8.

  Raises:
    ValueError: for ``bits`` or ``block`` outside the allowed values.

  Examples:
    >>> import jax.numpy as jnp
    >>> from heloco_jax import compress
    >>> c = compress.int_quantize(3, block=4)               # L = 3
    >>> delta = {"w": jnp.array([0.375, -0.75, 0.125, 0.0, 2.0])}
    >>> payload, _ = c.compress(delta, c.init(delta))
    >>> payload["w"].codes.tolist()  # s = 0.75/3: 1.5 → 2 and 0.5 → 0 (ties to even)
    [[2, -3, 0, 0], [3, 0, 0, 0]]
    >>> payload["w"].scale.tolist()                          # 0.75/3 and 2/3 in float32
    [0.25, 0.6666666865348816]
    >>> c.nbytes(payload)                                   # ⌈5·3/8⌉ + 2·4
    10
  """
  return _int_quantize("int_quantize", bits, block)


def int8(*, block: int = 256) -> Compressor:
  """``int_quantize(8, block=block)``: codes in [−127, 127], one byte per entry.

  Examples:
    >>> import jax.numpy as jnp
    >>> from heloco_jax import compress
    >>> c = compress.int8(block=256)
    >>> delta = {"w": jnp.ones(1000)}
    >>> payload, _ = c.compress(delta, c.init(delta))
    >>> payload["w"].codes.shape, payload["w"].scale.shape  # 4 blocks, the last one padded
    ((4, 256), (4,))
    >>> c.nbytes(payload)  # 1000 codes of one byte + 4 float32 scales
    1016
  """
  return _int_quantize("int8", 8, block)


def int4(*, block: int = 256) -> Compressor:
  """``int_quantize(4, block=block)``: codes in [−7, 7], half a byte per entry.

  Examples:
    >>> import jax.numpy as jnp
    >>> from heloco_jax import compress
    >>> c = compress.int4()
    >>> delta = {"w": jnp.ones(1000)}
    >>> payload, _ = c.compress(delta, c.init(delta))
    >>> c.nbytes(payload)  # 500 bytes of codes + 4 float32 scales
    516
  """
  return _int_quantize("int4", 4, block)


def int2(*, block: int = 256) -> Compressor:
  """``int_quantize(2, block=block)``: codes in {−1, 0, 1}, a quarter byte per entry.

  Examples:
    >>> import jax.numpy as jnp
    >>> from heloco_jax import compress
    >>> c = compress.int2(block=4)
    >>> delta = {"w": jnp.array([0.2, -0.5, 1.0, -0.7])}
    >>> payload, _ = c.compress(delta, c.init(delta))
    >>> payload["w"].codes.tolist(), c.decompress(payload)["w"].tolist()
    ([[0, 0, 1, -1]], [0.0, 0.0, 1.0, -1.0])
  """
  return _int_quantize("int2", 2, block)


def top_k(fraction: float) -> Compressor:
  """Per leaf, the k = max(1, ⌈f·n⌉) entries of largest |x|; the others are sent as 0.

  Ties are broken as ``jax.lax.top_k`` breaks them (the lower index first).

  Args:
    fraction: f, the fraction of each leaf's entries to keep, in (0, 1].

  Returns:
    A ``Compressor``: per leaf, k float32 values and k int32 flat indices,
    8·k bytes; ``decompress`` scatters the values into zeros.

  Raises:
    ValueError: for ``fraction`` outside (0, 1].

  Examples:
    >>> import jax.numpy as jnp
    >>> from heloco_jax import compress
    >>> c = compress.top_k(0.5)
    >>> delta = {"w": jnp.array([0.1, -3.0, 2.0, 0.5])}
    >>> payload, _ = c.compress(delta, c.init(delta))
    >>> c.decompress(payload)["w"].tolist(), c.nbytes(payload)
    ([0.0, -3.0, 2.0, 0.0], 16)
  """
  _validation.check_range("top_k", "fraction", fraction, 0.0, 1.0, low_open=True)
  compress_leaf = functools.partial(_top_k_leaf, fraction=float(fraction))
  leaf_nbytes = lambda p: _nbytes(p.values) + _nbytes(p.indices)
  return _per_leaf(compress_leaf, _top_k_back, leaf_nbytes, Sparse)


@functools.partial(jax.jit, static_argnames=("fraction",))
def _top_k_leaf(x: jax.Array, *, fraction: float) -> Sparse:
  # ALGORITHMS.md, "Compression of pseudo-gradients": top-k.
  spec = _spec("top_k", x)
  flat = jnp.ravel(jnp.asarray(x, jnp.float32))
  _, indices = jax.lax.top_k(jnp.abs(flat), top_k_count(spec.size, fraction))
  return Sparse(flat[indices], indices.astype(jnp.int32), spec)


@jax.jit
def _top_k_back(p: Sparse) -> jax.Array:
  flat = jnp.zeros((p.spec.size,), jnp.float32).at[p.indices].set(p.values)
  return flat.reshape(p.spec.shape).astype(p.spec.dtype)


def error_feedback(compressor: Compressor) -> Compressor:
  """Error feedback around ``compressor``: what it drops is added to the next Δ.

  e_0 = 0; p_t = C(Δ_t + e_{t−1}); e_t = Δ_t + e_{t−1} − D(p_t). So the sum of
  what the server received, D(p_1) + … + D(p_t), is Δ_1 + … + Δ_t − e_t: it
  lags the sum of the pseudo-gradients by one step's compression error only.

  Args:
    compressor: the ``Compressor`` C (with D its ``decompress``).

  Returns:
    A ``Compressor`` with the same payload, ``decompress`` and ``nbytes`` as C;
    its state is an ``ErrorFeedbackState`` (the residual e in at least float32,
    the shape of the parameters, and C's state). The decompressed tree has the
    dtypes of Δ + e (at least float32).

  Raises:
    ValueError: when ``compressor`` is not a ``Compressor``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from heloco_jax import compress
    >>> c = compress.error_feedback(compress.top_k(0.5))
    >>> state = c.init({"w": jnp.zeros(2)})
    >>> sent = []
    >>> for _ in range(3):
    ...   payload, state = c.compress({"w": jnp.array([1.0, 0.5])}, state)
    ...   sent.append(c.decompress(payload)["w"].tolist())
    >>> sent   # the small entry goes once its residual has grown past the large one
    [[1.0, 0.0], [1.0, 0.0], [0.0, 1.5]]
    >>> state.residual["w"].tolist()   # 3·Δ − (the sum of what was sent)
    [1.0, 0.0]
  """
  if not isinstance(compressor, Compressor):
    _fail("error_feedback", "compressor", compressor,
          "a Compressor, e.g. heloco_jax.comm.compress.int8()")

  def init_fn(params):
    def zeros(p):
      shape, dtype = _shape_dtype(p)
      return jnp.zeros(shape, jnp.promote_types(dtype, jnp.float32))
    return ErrorFeedbackState(jax.tree.map(zeros, params), compressor.init(params))

  # ALGORITHMS.md, "Compression of pseudo-gradients": error feedback.
  def compress_fn(delta, state):
    corrected = jax.tree.map(_add_residual, delta, state.residual)
    payload, inner = compressor.compress(corrected, state.inner)
    residual = jax.tree.map(_new_residual, corrected, compressor.decompress(payload))
    return payload, ErrorFeedbackState(residual, inner)

  return Compressor(init_fn, compress_fn, compressor.decompress, compressor.nbytes)


@jax.jit
def _add_residual(delta: jax.Array, residual: jax.Array) -> jax.Array:
  """v = Δ + e, in e's dtype (at least float32)."""
  return jnp.asarray(delta, residual.dtype) + residual


@jax.jit
def _new_residual(corrected: jax.Array, sent: jax.Array) -> jax.Array:
  """e' = v − D(p), D(p) rounded as the server gets it (``_unfused``)."""
  return corrected - _unfused(sent)


_error_feedback = error_feedback  # by_name's keyword of the same name hides it


def by_name(
    kind: Kind,
    *,
    block: int = 256,
    fraction: float = 0.01,
    error_feedback: bool = False,
) -> Compressor:
  """The compressor the run config names.

  Args:
    kind: "none", "bf16", "fp8", "int8", "int4", "int2" or "top_k".
    block: entries per scale of the integer quantizers, an integer >= 1
      (default 256; read by "int8", "int4" and "int2", checked for every kind).
    fraction: the fraction of entries "top_k" keeps, in (0, 1] (default 0.01;
      checked for every kind).
    error_feedback: wrap the compressor in ``error_feedback`` (default False).

  Returns:
    A ``Compressor``.

  Raises:
    ValueError: for an argument outside its allowed values.

  Examples:
    >>> import jax.numpy as jnp
    >>> from heloco_jax import compress
    >>> c = compress.by_name("top_k", fraction=0.01, error_feedback=True)
    >>> delta = {"w": jnp.ones(1000)}
    >>> payload, state = c.compress(delta, c.init(delta))
    >>> c.nbytes(payload)  # 10 float32 values + 10 int32 indices
    80
    >>> compress.by_name("int3")
    Traceback (most recent call last):
    ...
    ValueError: by_name: kind='int3' is not allowed; allowed: one of 'none', 'bf16', 'fp8', 'int8', 'int4', 'int2', 'top_k'.
  """
  _validation.check_choice("by_name", "kind", kind, KINDS)
  _check_block("by_name", block)
  _validation.check_range("by_name", "fraction", fraction, 0.0, 1.0, low_open=True)
  if not isinstance(error_feedback, (bool, np.bool_)):
    _fail("by_name", "error_feedback", error_feedback, "True or False")
  builders = {
      "none": none, "bf16": bf16, "fp8": fp8,
      "int8": lambda: int8(block=block), "int4": lambda: int4(block=block),
      "int2": lambda: int2(block=block), "top_k": lambda: top_k(fraction),
  }
  compressor = builders[kind]()
  return _error_feedback(compressor) if error_feedback else compressor


# --------------------------------------------------------------------------------------------
# in a run: how a worker's Δ reaches the server
# --------------------------------------------------------------------------------------------
class Message(NamedTuple):
  """What a worker sends of its Δ (``send``): the compressor's payload, and whether Δ held
  NaN or ±Inf (two flags beside the payload; a Δ that held either is rejected)."""
  payload: Any
  has_nan: jax.Array
  has_inf: jax.Array


def send(compressor: Compressor, delta: Any, state: Any) -> tuple[Message, Any]:
  """The worker's side of ``transmit``: (its ``Message``, its next compressor state).

  Runs where Δ is (a worker's devices); only the message crosses to the server
  (``receive``). The state is left as it was when Δ or its compression is not finite.
  """
  payload, new_state = compressor.compress(delta, state)
  received = _decompressed(compressor, payload, delta)
  has_nan, has_inf = _nonfinite(delta)
  ok = ~(has_nan | has_inf) & _all_finite(received)
  new_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state, state)
  return Message(payload, has_nan, has_inf), new_state


def receive(compressor: Compressor, message: Message, like: Any) -> Any:
  """The server's side of ``transmit``: D(payload) in the dtypes of ``like`` (Δ's shapes
  and dtypes: arrays or ``jax.ShapeDtypeStruct``s). A Δ that held NaN (±Inf) is received as
  NaN (+Inf) everywhere: rejected for the same reason as the Δ it stands for."""
  received = _decompressed(compressor, message.payload, like)
  fill = jnp.where(message.has_nan, jnp.nan, jnp.inf)
  sent_finite = ~(message.has_nan | message.has_inf)
  return jax.tree.map(lambda r: jnp.where(sent_finite, r, fill.astype(r.dtype)), received)


def transmit(compressor: Compressor, delta: Any, state: Any) -> tuple[Any, Any]:
  """What the server receives of a worker's Δ, and the worker's next compressor state.

  D(C(Δ)) in Δ's dtypes (ALGORITHMS.md, "Compression in a run"): ``send`` then
  ``receive`` in one program. A Δ that is not finite is received as it is, and one whose
  compression is not finite (e.g. bf16 overflow) as compressed: the server rejects both
  (``heloco_jax.training.rejection``); the worker's state is then left as it was, so
  that an error-feedback residual never holds NaN. Pure: ``jax.jit`` and
  ``jax.vmap`` (over stacked workers) take it.

  Args:
    compressor: the ``Compressor``.
    delta: the worker's pseudo-gradient Δ (a tree of float arrays).
    state: the worker's compressor state (``compressor.init(params)`` at first).

  Returns:
    (received, state): a tree like Δ, and the state for the worker's next Δ.
  """
  message, new_state = send(compressor, delta, state)
  sent_finite = ~(message.has_nan | message.has_inf)
  received = _decompressed(compressor, message.payload, delta)
  received = jax.tree.map(lambda r, d: jnp.where(sent_finite, r, d), received, delta)
  return received, new_state


def _decompressed(compressor: Compressor, payload: Any, like: Any) -> Any:
  return jax.tree.map(lambda r, d: jnp.asarray(r, d.dtype), compressor.decompress(payload), like)


def _nonfinite(tree: Any) -> tuple[jax.Array, jax.Array]:
  leaves = jax.tree.leaves(tree)
  return (jnp.any(jnp.stack([jnp.any(jnp.isnan(x)) for x in leaves])),
          jnp.any(jnp.stack([jnp.any(jnp.isinf(x)) for x in leaves])))


def _all_finite(tree: Any) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def payload_nbytes(compressor: Compressor | None, params: Any) -> int:
  """Bytes of one worker's Δ on the wire: ``compressor.nbytes`` of its payload for a
  Δ like ``params`` (shapes and dtypes only; no device work), or Δ's own bytes for None."""
  if compressor is None:
    return sum(_nbytes(x) for x in jax.tree.leaves(params))
  state = jax.eval_shape(compressor.init, params)
  payload, _ = jax.eval_shape(compressor.compress, params, state)
  nbytes = compressor.nbytes(payload)
  if (isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer, float, np.floating))
      or not np.isfinite(nbytes) or nbytes < 0 or int(nbytes) != nbytes):
    raise ValueError(f"compress: nbytes(payload) returned {nbytes!r}; allowed: an integer >= 0 "
                     "(the payload's bytes on the wire, which the simulated clock charges)")
  back = jax.eval_shape(compressor.decompress, payload)
  want = jax.tree.map(lambda x: (np.shape(x), np.dtype(x.dtype)), params)
  try:
    got = jax.tree.map(lambda x: (np.shape(x), np.dtype(x.dtype)), back)
  except AttributeError:
    got = None
  if jax.tree.structure(back) != jax.tree.structure(params) or got != want:
    raise ValueError("compress: decompress(payload) gives "
                     f"{jax.tree.map(lambda x: getattr(x, 'shape', x), back)}; allowed: Δ's "
                     "structure, shapes and dtypes (those of params)")
  return int(nbytes)
