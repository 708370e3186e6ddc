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
