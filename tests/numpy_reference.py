"""Independent float64 NumPy reference of the outer optimizers in ALGORITHMS.md.

Written from the spec (sections "Asynchronous methods" and "The HeLoCo correction of one
block b") only, without looking at the library, so that the tests comparing the two are an
independent check.

Representation: a "tree" here is a plain Python list of ``np.float64`` arrays (the leaves, in
any fixed order; the tests use ``jax.tree_util.tree_leaves`` order). Every optimizer is a tiny
stateful object with ``step(theta, delta, staleness) -> new_theta``; the momentum (and, for
HeLoCo, the diagnostics of the last arrival) are kept on the object.

Notation (ALGORITHMS.md): pseudo-gradient Delta, arrival weight rho, g = rho * Delta,
outer learning rate eta, outer momentum mu, momentum m (starts at 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

Tree = List[np.ndarray]

PASS, KEEP, SHRINK, ROTATE = 0, 1, 2, 3
BRANCH_NAMES = ("pass", "keep", "shrink", "rotate")


# --------------------------------------------------------------------------------------------
# small tree helpers
# --------------------------------------------------------------------------------------------
def as_tree(leaves: Sequence) -> Tree:
    """Copy ``leaves`` into float64 arrays."""
    return [np.array(x, dtype=np.float64, copy=True) for x in leaves]


def zeros_like(tree: Tree) -> Tree:
    return [np.zeros_like(np.asarray(x, dtype=np.float64)) for x in tree]


def tree_norm(tree: Tree) -> float:
    return math.sqrt(sum(float(np.sum(np.square(x))) for x in tree))


def flatten(tree: Tree) -> np.ndarray:
    if not tree:
        return np.zeros((0,), np.float64)
    return np.concatenate([np.ravel(x) for x in tree])


def unflatten(vec: np.ndarray, like: Tree) -> Tree:
    out, i = [], 0
    for x in like:
        n = int(np.size(x))
        out.append(np.reshape(vec[i:i + n], np.shape(x)).astype(np.float64))
        i += n
    assert i == vec.size
    return out


# --------------------------------------------------------------------------------------------
# arrival weight rho
# --------------------------------------------------------------------------------------------
def arrival_weight(num_workers: Optional[int], weighting: str, staleness) -> float:
    """rho. ``num_workers=None`` means rho = 1 whatever ``weighting`` says."""
    if weighting not in ("constant", "polynomial", "none"):
        raise ValueError(f"unknown weighting {weighting!r}")
    if num_workers is None:
        return 1.0
    k = float(num_workers)
    tau = float(staleness)
    if weighting == "constant":
        return 1.0 / math.sqrt(k)
    if weighting == "polynomial":
        return (1.0 / math.sqrt(k)) / math.sqrt(1.0 + tau)
    return 1.0  # "none"


def age_gate(staleness, decay: float, cutoff: float) -> float:
    """CGAD's sigma(tau) = gamma(tau) exp(-alpha tau), gamma = (1 + cos(pi tau / tau_c)) / 2
    below the cutoff and 0 from it on (ALGORITHMS.md, "CGAD")."""
    tau = float(staleness)
    gate = 1.0 if math.isinf(cutoff) else (
        0.5 * (1.0 + math.cos(math.pi * tau / cutoff)) if tau < cutoff else 0.0)
    return gate * math.exp(-decay * tau)


# --------------------------------------------------------------------------------------------
# HeLoCo correction
# --------------------------------------------------------------------------------------------
@dataclass
class BlockInfo:
    cosine: float            # 0 for pass blocks; clipped to [-1, 1]
    confidence: float        # ||d|| / (||d|| + kappa ||m_b|| + eps), computed for every block
    branch: int              # 0 pass, 1 keep, 2 shrink, 3 rotate
    rotation: float          # lambda; 0 unless rotate
    shrinkage: float         # beta; 0 unless shrink
    relative_correction: float  # ||d_hat - d|| / ||d||; 0 for pass


def rotation_schedule(c: float, keep_threshold: float, bad_threshold: float,
                      schedule: str) -> float:
    """r(c)."""
    if schedule == "normalized":
        r = (keep_threshold - c) / (keep_threshold - bad_threshold)
        return min(max(r, 0.0), 1.0)
    if schedule == "eq14":
        return 1.0 - c
    raise ValueError(f"unknown rotate_schedule {schedule!r}")


def correct_block(d: np.ndarray, m: np.ndarray, *, keep_threshold=0.2, bad_threshold=-0.2,
                  shrink_strength=0.5, max_shrink=0.5, rotate_strength=1.0,
                  confidence_scale=3.0, eps=1e-8, rotate_schedule="normalized"
                  ) -> Tuple[np.ndarray, BlockInfo]:
    """Correction of one block (both arguments flat or same-shaped float64 arrays)."""
    d = np.asarray(d, np.float64)
    m = np.asarray(m, np.float64)
    nd = float(np.sqrt(np.sum(d * d)))
    nm = float(np.sqrt(np.sum(m * m)))
    conf = nd / (nd + confidence_scale * nm + eps)
    if nd < eps or nm < eps:
        return d.copy(), BlockInfo(0.0, conf, PASS, 0.0, 0.0, 0.0)
    c = float(np.sum(d * m)) / (nd * nm)
    c = min(max(c, -1.0), 1.0)
    lam = beta = 0.0
    if c >= keep_threshold:
        d_hat, branch = d.copy(), KEEP
    elif c < 0.0:
        beta = min(shrink_strength * (-c) * conf, max_shrink)
        d_hat = d - beta * c * nd * m / nm
        branch = SHRINK
    else:
        lam = min(rotate_strength * rotation_schedule(c, keep_threshold, bad_threshold,
                                                      rotate_schedule) * conf, 1.0)
        u = (1.0 - lam) * d / nd + lam * m / nm
        nu = float(np.sqrt(np.sum(u * u)))
        d_hat = nd * u / max(nu, eps)
        branch = ROTATE
    rel = float(np.sqrt(np.sum((d_hat - d) ** 2))) / nd
    return d_hat, BlockInfo(c, conf, branch, lam, beta, rel)


CORRECTION_KEYS = ("keep_threshold", "bad_threshold", "shrink_strength", "max_shrink",
                   "rotate_strength", "confidence_scale", "eps", "rotate_schedule")


def correct(d_tree: Tree, m_tree: Tree, *, scope: str = "leaf", **kw) -> Tuple[Tree, Dict]:
    """HeLoCo correction of a whole tree.  Does NOT apply rho.

    Returns (d_hat tree, info) with info a dict of per-block lists (one entry per leaf for
    scope "leaf", a single entry for scope "tree") plus ``branch_counts`` (np.int64[4]: pass,
    keep, shrink, rotate) and ``total_relative_correction`` (||d_hat - d|| / ||d|| over the
    whole tree, 0 if ||d|| < eps).
    """
    eps = kw.get("eps", 1e-8)
    d_tree = as_tree(d_tree)
    m_tree = as_tree(m_tree)
    if scope == "leaf":
        pairs = [correct_block(d, m, **kw) for d, m in zip(d_tree, m_tree)]
        d_hat = [p[0].reshape(np.shape(d)) for p, d in zip(pairs, d_tree)]
        infos = [p[1] for p in pairs]
    elif scope == "tree":
        flat_hat, binfo = correct_block(flatten(d_tree), flatten(m_tree), **kw)
        d_hat = unflatten(flat_hat, d_tree)
        infos = [binfo]
    else:
        raise ValueError(f"unknown scope {scope!r}")
    info = {f: [getattr(b, f) for b in infos] for f in
            ("cosine", "confidence", "branch", "rotation", "shrinkage", "relative_correction")}
    counts = np.zeros(4, np.int64)
    for b in infos:
        counts[b.branch] += 1
    info["branch_counts"] = counts
    nd = tree_norm(d_tree)
    diff = tree_norm([a - b for a, b in zip(d_hat, d_tree)])
    info["total_relative_correction"] = diff / nd if nd >= eps else 0.0
    return d_hat, info


# --------------------------------------------------------------------------------------------
# outer rules
# --------------------------------------------------------------------------------------------
class _Outer:
    def __init__(self, learning_rate, momentum, num_workers=None, weighting="constant"):
        self.lr = float(learning_rate)
        self.mu = float(momentum)
        self.num_workers = num_workers
        self.weighting = weighting
        arrival_weight(num_workers, weighting, 0)  # validates weighting
        self.m: Optional[Tree] = None
        self.count = 0
        self.weight = None  # rho of the last arrival

    def init(self, params: Sequence) -> "_Outer":
        self.m = zeros_like(as_tree(params))
        self.count = 0
        return self

    def rho(self, staleness) -> float:
        return arrival_weight(self.num_workers, self.weighting, staleness)

    def lookahead(self, theta: Tree) -> Tree:
        """theta - eta * mu * m (the dispatch point of HeLoCo / MLA with look-ahead)."""
        return [t - self.lr * self.mu * m for t, m in zip(as_tree(theta), self.m)]


class AsyncNesterov(_Outer):
    """m <- mu m + g ; theta <- theta - eta (g + mu m), g = rho Delta."""

    def step(self, theta, delta, staleness=0) -> Tree:
        rho = self.rho(staleness)
        self.weight = rho
        g = [rho * x for x in as_tree(delta)]
        self.m = [self.mu * m + gi for m, gi in zip(self.m, g)]
        self.count += 1
        return [t - self.lr * (gi + self.mu * m) for t, gi, m in zip(as_tree(theta), g, self.m)]


class CGAD:
    """g = sigma(tau) Delta; m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g^2;
    theta <- theta - eta (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)."""

    def __init__(self, learning_rate, b1=0.9, b2=0.99, eps=1e-8, *, decay=0.1, cutoff=32.0):
        self.lr, self.b1, self.b2, self.eps = map(float, (learning_rate, b1, b2, eps))
        self.decay, self.cutoff = float(decay), float(cutoff)

    def init(self, params: Sequence) -> "CGAD":
        self.m = zeros_like(as_tree(params))
        self.v = zeros_like(as_tree(params))
        self.count = 0
        return self

    def step(self, theta, delta, staleness=0) -> Tree:
        sigma = age_gate(staleness, self.decay, self.cutoff)
        g = [sigma * x for x in as_tree(delta)]
        self.m = [self.b1 * m + (1 - self.b1) * gi for m, gi in zip(self.m, g)]
        self.v = [self.b2 * v + (1 - self.b2) * gi * gi for v, gi in zip(self.v, g)]
        self.count += 1
        m_hat = [m / (1 - self.b1 ** self.count) for m in self.m]
        v_hat = [v / (1 - self.b2 ** self.count) for v in self.v]
        return [t - self.lr * mh / (np.sqrt(vh) + self.eps)
                for t, mh, vh in zip(as_tree(theta), m_hat, v_hat)]


class DelayedNesterov(_Outer):
    """Liu et al. Alg. 3 as written in ALGORITHMS.md (buffer N, c in [0, 1/N])."""

    def __init__(self, learning_rate, momentum=0.9, *, buffer_size, c=0.0, num_workers=None,
                 weighting="constant"):
        super().__init__(learning_rate, momentum, num_workers, weighting)
        self.N = int(buffer_size)
        self.c = float(c)
        self.buffer: Optional[Tree] = None

    def init(self, params):
        super().init(params)
        self.buffer = zeros_like(as_tree(params))
        return self

    def step(self, theta, delta, staleness=0) -> Tree:
        rho = self.rho(staleness)
        self.weight = rho
        g = [rho * x for x in as_tree(delta)]
        self.count += 1                                   # t <- t + 1
        self.buffer = [b + gi for b, gi in zip(self.buffer, g)]  # D <- D + g
        N, c, mu, eta = self.N, self.c, self.mu, self.lr
        theta = as_tree(theta)
        if self.count % N == 0:
            self.m = [mu * m + b / N for m, b in zip(self.m, self.buffer)]
            new = [t - eta * ((1.0 - c * N + c) * mu * m + gi / N)
                   for t, m, gi in zip(theta, self.m, g)]
            self.buffer = zeros_like(self.buffer)
        else:
            new = [t - eta * (c * mu * m + gi / N) for t, m, gi in zip(theta, self.m, g)]
        return new


class MLA(_Outer):
    """m <- mu m + (1 - mu) g ; theta <- theta - eta (g + mu m)."""

    def _momentum_step(self, theta, G) -> Tree:
        self.m = [self.mu * m + (1.0 - self.mu) * gi for m, gi in zip(self.m, G)]
        self.count += 1
        return [t - self.lr * (gi + self.mu * m) for t, gi, m in zip(as_tree(theta), G, self.m)]

    def step(self, theta, delta, staleness=0) -> Tree:
        rho = self.rho(staleness)
        self.weight = rho
        g = [rho * x for x in as_tree(delta)]
        return self._momentum_step(theta, g)


class HeLoCo(MLA):
    """MLA rule on the corrected update G.

    weight_order "before": d = rho Delta_b, G = d_hat.   "after": d = Delta_b, G = rho Delta_hat.
    The correction uses the momentum BEFORE this arrival.  ``self.info`` holds the diagnostics
    of the last arrival's correction (computed on whatever d the correction saw), ``self.G``
    the update that was fed to the momentum step.
    """

    def __init__(self, learning_rate=0.7, momentum=0.9, *, num_workers=None,
                 weighting="constant", keep_threshold=0.2, bad_threshold=-0.2,
                 shrink_strength=0.5, max_shrink=0.5, rotate_strength=1.0,
                 confidence_scale=3.0, eps=1e-8, rotate_schedule="normalized",
                 weight_order="before", scope="leaf"):
        super().__init__(learning_rate, momentum, num_workers, weighting)
        if weight_order not in ("before", "after"):
            raise ValueError(weight_order)
        if scope not in ("leaf", "tree"):
            raise ValueError(scope)
        self.corr_kw = dict(keep_threshold=keep_threshold, bad_threshold=bad_threshold,
                            shrink_strength=shrink_strength, max_shrink=max_shrink,
                            rotate_strength=rotate_strength, confidence_scale=confidence_scale,
                            eps=eps, rotate_schedule=rotate_schedule)
        self.weight_order = weight_order
        self.scope = scope
        self.info = None
        self.G = None

    def step(self, theta, delta, staleness=0) -> Tree:
        rho = self.rho(staleness)
        self.weight = rho
        delta = as_tree(delta)
        if self.weight_order == "before":
            d = [rho * x for x in delta]
            G, self.info = correct(d, self.m, scope=self.scope, **self.corr_kw)
        else:
            d_hat, self.info = correct(delta, self.m, scope=self.scope, **self.corr_kw)
            G = [rho * x for x in d_hat]
        self.G = G
        return self._momentum_step(theta, G)

    def step_group(self, theta, deltas, stalenesses, weights,
                   merge_order="merge_then_correct") -> Tree:
        """One update for a group of arrivals (ALGORITHMS.md, "Merge order under a quorum").

        merge_then_correct: the merged rho(tau_max) Delta = sum_j w_j rho(tau_j) Delta_j is
        corrected once, as one arrival of staleness tau_max (``step``).
        correct_then_merge: G_j is arrival j's corrected update as if it arrived alone (against
        the same m, with its own rho(tau_j) and weight order); G = sum_j w_j G_j; then the
        momentum step with G.  ``self.infos`` holds the arrivals' diagnostics.
        """
        deltas = [as_tree(d) for d in deltas]
        if merge_order == "merge_then_correct":
            tau_max = max(stalenesses)
            rho_max = self.rho(tau_max)
            merged = [sum(w * self.rho(t) / rho_max * d[i]
                          for d, t, w in zip(deltas, stalenesses, weights))
                      for i in range(len(deltas[0]))]
            return self.step(theta, merged, tau_max)
        if merge_order != "correct_then_merge":
            raise ValueError(merge_order)
        corrected, self.infos = [], []
        for d, t in zip(deltas, stalenesses):
            rho = self.rho(t)
            if self.weight_order == "before":
                G_j, info = correct([rho * x for x in d], self.m, scope=self.scope,
                                    **self.corr_kw)
            else:
                d_hat, info = correct(d, self.m, scope=self.scope, **self.corr_kw)
                G_j = [rho * x for x in d_hat]
            corrected.append(G_j)
            self.infos.append(info)
        G = [sum(w * G_j[i] for G_j, w in zip(corrected, weights))
             for i in range(len(deltas[0]))]
        self.G = G
        return self._momentum_step(theta, G)


# --------------------------------------------------------------------------------------------
# compression of pseudo-gradients (ALGORITHMS.md, "Compression of pseudo-gradients")
# --------------------------------------------------------------------------------------------
# Written from the formulas of that section alone.  Every function takes one leaf x (any
# shape) and works in float32 where the formulas do (the scales, x / s, the products
# code * s), so that codes, scales and decompressed values can be compared bit for bit; the
# float8 and bfloat16 roundings are done here by hand (bit and power-of-two arithmetic), not
# by ml_dtypes.  ``*_roundtrip(x)`` returns D(C(x)) as float32: what the server gets, before
# the cast back to x's dtype.

E4M3_MAX = 448.0
COMPRESSION_KINDS = ("none", "bf16", "fp8", "int8", "int4", "int2", "top_k")
INT_BITS = {"int8": 8, "int4": 4, "int2": 2}


def round_bfloat16(x) -> np.ndarray:
    """Nearest bfloat16 value of float32 x (ties to even), as float32: keep the top 16 bits."""
    bits = np.array(x, np.float32).view(np.uint32).astype(np.uint64)
    bias = 0x7FFF + ((bits >> 16) & 1)
    return ((bits + bias) & 0xFFFF0000).astype(np.uint32).view(np.float32)


def round_e4m3(y) -> np.ndarray:
    """Nearest float8 e4m3fn value of y, |y| <= 448 (ties to even), as float32.

    e4m3fn: 3 mantissa bits, normal exponents -6..8, subnormals spaced 2^-9: the spacing
    around |y| in [2^e, 2^(e+1)) is 2^(max(e, -6) - 3).
    """
    y = np.array(y, np.float64)
    assert np.all(np.abs(y) <= E4M3_MAX)
    _, e = np.frexp(y)                      # |y| = m 2^e with m in [0.5, 1): floor(log2|y|) = e - 1
    quantum = np.ldexp(1.0, np.maximum(e - 1, -6) - 3)
    out = np.rint(y / quantum) * quantum    # division by a power of two: exact; rint: ties to even
    assert np.all(np.abs(out) <= E4M3_MAX)
    return out.astype(np.float32)


def bf16_roundtrip(x) -> np.ndarray:
    return round_bfloat16(x)


def fp8_compress(x) -> Tuple[np.ndarray, np.float32]:
    """(codes as float32 values, scale): s = max|x| / 448 (1 when 0), codes = e4m3(x / s)."""
    x = np.array(x, np.float32)
    amax = np.float32(np.max(np.abs(x), initial=0.0))
    scale = np.float32(1.0) if amax == 0 else np.float32(amax / np.float32(E4M3_MAX))
    codes = round_e4m3(np.clip(x / scale, -E4M3_MAX, E4M3_MAX))
    return codes, scale


def fp8_roundtrip(x) -> np.ndarray:
    codes, scale = fp8_compress(x)
    return (codes * scale).astype(np.float32)


def int_levels(bits: int) -> int:
    """L = 2^(bits-1) - 1."""
    return 2 ** (bits - 1) - 1


def int_compress(x, bits: int, block: int) -> Tuple[np.ndarray, np.ndarray]:
    """(codes int8 of shape (num_blocks, block), scales float32 of shape (num_blocks,)).

    The flat leaf, zero-padded to a multiple of block; s_b = max|x_b| / L (1 for an all-zero
    block); codes = clip(round_half_even(x / s_b), -L, L).
    """
    flat = np.array(x, np.float32).ravel()
    n = flat.size
    num_blocks = -(-n // block)
    padded = np.zeros(num_blocks * block, np.float32)
    padded[:n] = flat
    blocks = padded.reshape(num_blocks, block)
    levels = np.float32(int_levels(bits))
    amax = np.max(np.abs(blocks), axis=1, initial=0.0).astype(np.float32)
    scales = np.where(amax == 0, np.float32(1.0), amax / levels).astype(np.float32)
    codes = np.clip(np.rint(blocks / scales[:, None]), -levels, levels).astype(np.int8)
    return codes, scales


def int_decompress(codes: np.ndarray, scales: np.ndarray, shape) -> np.ndarray:
    n = int(np.prod(shape, dtype=np.int64))
    values = (codes.astype(np.float32) * scales[:, None].astype(np.float32)).ravel()[:n]
    return values.reshape(shape).astype(np.float32)


def int_roundtrip(x, bits: int, block: int) -> np.ndarray:
    codes, scales = int_compress(x, bits, block)
    return int_decompress(codes, scales, np.shape(x))


def top_k_count(n: int, fraction: float) -> int:
    """k = max(1, ceil(f n)), at most n, with f n exact for the decimal f as written."""
    from decimal import Decimal
    k = math.ceil(Decimal(repr(float(fraction))) * n)
    return min(n, max(1, k))


def top_k_compress(x, fraction: float) -> Tuple[np.ndarray, np.ndarray]:
    """(values float32, flat indices int32) of the k entries of largest |x|; ties: lower index
    first."""
    flat = np.array(x, np.float32).ravel()
    order = np.argsort(-np.abs(flat), kind="stable")[:top_k_count(flat.size, fraction)]
    return flat[order], order.astype(np.int32)


def top_k_roundtrip(x, fraction: float) -> np.ndarray:
    values, indices = top_k_compress(x, fraction)
    flat = np.zeros(int(np.size(x)), np.float32)
    flat[indices] = values
    return flat.reshape(np.shape(x))


def roundtrip(kind: str, x, *, block: int = 256, fraction: float = 0.01) -> np.ndarray:
    """D(C(x)) for one leaf, as float32 (x as it is for "none")."""
    if kind == "none":
        return np.array(x, copy=True)
    if kind == "bf16":
        return bf16_roundtrip(x)
    if kind == "fp8":
        return fp8_roundtrip(x)
    if kind in INT_BITS:
        return int_roundtrip(x, INT_BITS[kind], block)
    if kind == "top_k":
        return top_k_roundtrip(x, fraction)
    raise ValueError(f"unknown compression kind {kind!r}")


def compressed_nbytes(kind: str, shape, itemsize: int = 4, *, block: int = 256,
                      fraction: float = 0.01) -> int:
    """Bytes on the wire for one leaf of the given shape (itemsize: of the leaf's dtype)."""
    n = int(np.prod(shape, dtype=np.int64))
    if kind == "none":
        return n * itemsize
    if kind == "bf16":
        return 2 * n
    if kind == "fp8":
        return n + 4
    if kind in INT_BITS:
        return math.ceil(n * INT_BITS[kind] / 8) + 4 * (-(-n // block))
    if kind == "top_k":
        return 8 * top_k_count(n, fraction)
    raise ValueError(f"unknown compression kind {kind!r}")


def error_feedback(leaf_roundtrip, deltas: Sequence[Tree], dtype=np.float64
                   ) -> Tuple[List[Tree], List[Tree], List[Tree]]:
    """Error feedback over a sequence of pseudo-gradients (each a list of leaves).

    e_0 = 0; v_t = Delta_t + e_{t-1}; p_t = C(v_t); e_t = v_t - D(p_t), all in ``dtype``
    (``leaf_roundtrip`` is D(C(.)) of one leaf).  Returns the lists of v_t, D(p_t) and e_t.
    """
    corrected, sent, residuals = [], [], []
    e = None
    for delta in deltas:
        delta = [np.asarray(d, dtype) for d in delta]
        if e is None:
            e = [np.zeros_like(d) for d in delta]
        v = [d + ei for d, ei in zip(delta, e)]
        d_hat = [np.asarray(leaf_roundtrip(vi), dtype) for vi in v]
        e = [vi - di for vi, di in zip(v, d_hat)]
        corrected.append(v)
        sent.append(d_hat)
        residuals.append(e)
    return corrected, sent, residuals


def download_starts(leaf_roundtrip, points: Sequence[Tree]) -> List[Tree]:
    """Compressed downloads (ALGORITHMS.md, "Compressed downloads"): the starts a worker
    builds from the dispatch points θ_d it is sent, in float32. The first is θ_d itself;
    then x̂ ← x̂ + D(C(θ_d − x̂)) (``leaf_roundtrip`` is D(C(.)) of one leaf)."""
    held, starts = None, []
    for point in points:
        point = [np.asarray(p, np.float32) for p in point]
        if held is None:
            held = point
        else:
            held = [h + np.asarray(leaf_roundtrip(p - h), np.float32)
                    for h, p in zip(held, point)]
        starts.append(held)
    return starts
