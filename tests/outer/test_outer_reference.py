"""heloco_jax outer optimizers against the independent float64 NumPy reference.

``tests/numpy_reference.py`` implements ALGORITHMS.md ("Asynchronous methods" and "The HeLoCo
correction of one block b") in float64 from the spec alone.  Here every public outer rule
(heloco, mla, async_nesterov, delayed_nesterov) and every option is run by the library in
float32 (JAX default; x64 is NOT enabled) over >= 30 arrivals on a multi-leaf pytree, and
theta / momentum / diagnostics are compared with the reference after EVERY arrival.

How the arrivals are built.  The pseudo-gradients of a HeLoCo sequence are generated on the
fly from the *reference's* momentum (never the library's), so the sequence is a fixed input
that both implementations then consume.  Each block's Delta is built with a chosen cosine to
the momentum m_b (Delta_b = s (c u + sqrt(1 - c^2) v), u = m_b/|m_b|, v a random unit vector
orthogonal to u), with the target branch (keep / rotate / shrink) drawn at random and the
cosine drawn at least 0.02 inside the branch's interval; whole leaves (and once the whole
tree) are set to zero at some arrivals, and step 0 has m = 0, so every branch (pass included)
occurs.  Each Delta is rounded to float32 first, so both sides see bit-identical inputs, and
any candidate whose reference cosines come within MARGIN of c_ok, 0 or c_bad is redrawn:
float32 rounding cannot then flip a branch, and the tests assert that too.

Set HELOCO_FULL_SWEEP=1 to run the full schedule x order x scope x weighting product (24
HeLoCo configs) instead of the default 8-config covering set (kept small for speed).

Tolerances (all justified where they are defined, below): float32 epsilon is 1.19e-7; the
library accumulates rounding over 40 arrivals in float32 while the reference is float64.
"""

from __future__ import annotations

import functools
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy_reference as ref  # noqa: E402

try:
    import heloco_jax as hj
except ImportError as exc:  # the reference self-checks below still run
    hj = None
    _HJ_IMPORT_ERROR = exc


def _lib():
    if hj is None:
        pytest.fail(f"heloco_jax cannot be imported: {_HJ_IMPORT_ERROR!r}")
    return hj


# ---------------------------------------------------------------------------------------------
# tolerances
# ---------------------------------------------------------------------------------------------
# theta / momentum after every arrival (40 arrivals).  Each float32 op rounds with relative
# error <= 6e-8 (eps/2).  The momentum recursion m <- mu m + (1-mu) G contracts old errors by
# mu = 0.9 per step, so its steady-state relative error is about eps/(1-mu) ~ 1e-6; theta is a
# running sum of 40 updates, each of relative error ~1e-6, so ~1e-5 relative to the size of the
# updates is the worst expected.  Corrections (rotate/shrink) depend on the library's own
# (slightly different) float32 momentum through c and conf; their derivatives are O(1)
# (dr/dc = 1/(c_ok - c_bad) <= 4 here), which does not change the order of magnitude.
# Hence rtol = 2e-5, plus an absolute floor of 2e-6 x (the largest |entry| the leaf -- or, for
# scope="tree", the whole tree -- has had so far in the reference trajectory, see
# RunningScale) for entries that pass near zero (cancellation leaves an absolute, not relative,
# error).  Measured against the library: the worst comparison uses ~0.18 of this tolerance
# (HeLoCo momentum/theta), ~0.08 for MLA / async Nesterov, ~0.15 for DN.  A genuine rule error
# (wrong coefficient, wrong branch, wrong order of rho) shows up at 1e-3..1e-1, orders of
# magnitude above these.
TRAJ_RTOL = 2e-5
TRAJ_ATOL_REL = 2e-6
# Diagnostics are O(1) unitless numbers in [-1, 1] (cosine) or [0, 1] (conf, lambda, beta) or
# a small ratio (relative correction).  The cosine from float32 dot products of <= 99 entries
# has absolute error ~1e-6; with the library's momentum drifting ~1e-6 relative from the
# reference, lambda = k_d r(c) conf (k_d <= 3, dr/dc <= 4) moves by at most ~1e-5.
# (Measured: worst diagnostic error ~1.3e-6, i.e. ~0.06 of this.)
DIAG_ATOL = 2e-5
# hj.heloco_correct() on bit-identical float32 inputs: only the rounding of one correction (no
# accumulation), so the corrected update must match to a few float32 ulps (measured: ~0.3 of
# this tolerance).
CORRECT_RTOL = 1e-5
CORRECT_ATOL_REL = 1e-6
# state.weight (rho) is one float32 sqrt/division: a few ulps.
WEIGHT_RTOL = 1e-6

# No reference cosine may come closer than this to c_ok, 0 or c_bad (float32 cosine error is
# ~1e-6, so a branch decision cannot flip).
MARGIN = 1e-3

N_ARRIVALS = 40

# ---------------------------------------------------------------------------------------------
# the pytree: a matrix, a vector, a 3-D tensor and a scalar leaf
# ---------------------------------------------------------------------------------------------
SHAPES = {"mat": (6, 5), "vec": (8,), "cube": (2, 3, 4), "scal": ()}
_TEMPLATE = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
_LEAVES, TREEDEF = jax.tree_util.tree_flatten(_TEMPLATE)
LEAF_NAMES = [jax.tree_util.keystr(p)
              for p, _ in jax.tree_util.tree_flatten_with_path(_TEMPLATE)[0]]
LEAF_INDEX = {k: LEAF_NAMES.index(f"['{k}']") for k in SHAPES}
LEAF_SHAPES = [x.shape for x in _LEAVES]
N_LEAVES = len(LEAF_SHAPES)

# arrivals at which one leaf (or the whole tree) of Delta is exactly zero.  Step 0 also zeroes
# the scalar leaf, so at step 1 that leaf has m_b = 0 but d != 0 (pass with ||m|| < eps).
ZERO_LEAF_STEPS = {0: "scal", 5: "vec", 12: "scal", 20: "mat", 27: "cube", 33: "vec"}
ZERO_ALL_STEPS = {17}


def f32(leaves):
    """Round to float32 and back: the exact values the library will see."""
    return [np.asarray(np.asarray(x, np.float32), np.float64) for x in leaves]


def to_jax(leaves):
    return jax.tree_util.tree_unflatten(TREEDEF, [jnp.asarray(x, jnp.float32) for x in leaves])


def to_np(tree):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    assert treedef == TREEDEF, (treedef, TREEDEF)
    return [np.asarray(x, np.float64) for x in leaves]


def theta0(seed=0):
    rng = np.random.default_rng(10_000 + seed)
    return f32([rng.normal(size=s) for s in LEAF_SHAPES])


def assert_leaves_close(actual, expected, *, rtol, atol_rel, what, scale=None, scope="leaf"):
    """allclose per leaf with atol = atol_rel x scale[leaf] (default: the largest |entry| of the
    leaf, or of the whole tree when scope="tree": there the correction mixes all leaves, d/|d|
    and m/|m| are normalised over the whole tree, so the float32 rounding of a small leaf is
    relative to the whole block, not to that leaf)."""
    assert len(actual) == len(expected)
    if scale is None:
        scale = _scales(expected, scope)
    for name, a, e, sc in zip(LEAF_NAMES, actual, expected, scale):
        a = np.asarray(a, np.float64)
        assert a.shape == e.shape, (what, name, a.shape, e.shape)
        atol = atol_rel * sc + 1e-30
        if not np.all(np.abs(a - e) <= atol + rtol * np.abs(e)):  # fast path; report below
            np.testing.assert_allclose(a, e, rtol=rtol, atol=atol,
                                       err_msg=f"{what} leaf {name} (atol scale {sc:.3g})")


def _scales(leaves, scope):
    per_leaf = np.array([float(np.max(np.abs(x), initial=0.0)) for x in leaves])
    return np.full(len(leaves), per_leaf.max()) if scope == "tree" else per_leaf


class RunningScale:
    """Per-leaf (or, for scope="tree", per-tree) running max of |entries| over the trajectory.

    The float32 error of theta_t or m_t is accumulated over all earlier arrivals, so it is
    relative to the magnitudes the recursion has carried so far, not to the current value: a
    leaf that passes near zero (e.g. the scalar leaf) keeps an error of the size of its past
    values.  The atol of each comparison is atol_rel x this running max."""

    def __init__(self, scope="leaf", initial=None):
        self.scope = scope
        self.max = np.zeros(N_LEAVES)
        if initial is not None:
            self.update(initial)

    def update(self, leaves):
        self.max = np.maximum(self.max, _scales(leaves, self.scope))
        return self.max

    def check(self, actual, expected, *, what, rtol=None, atol_rel=None):
        assert_leaves_close(actual, expected, rtol=TRAJ_RTOL if rtol is None else rtol,
                            atol_rel=TRAJ_ATOL_REL if atol_rel is None else atol_rel,
                            what=what, scale=self.update(expected))


# ---------------------------------------------------------------------------------------------
# arrival generation
# ---------------------------------------------------------------------------------------------
def _unit(v):
    return v / np.linalg.norm(v)


def _block_direction(rng, m_vec, target, c_ok):
    """A unit vector whose cosine with m_vec lies inside the target branch's interval."""
    n = m_vec.size
    nm = float(np.linalg.norm(m_vec))
    if nm == 0.0:
        return _unit(rng.normal(size=n))
    u = m_vec / nm
    if n == 1:  # a scalar block: cosine is +-1, only keep or shrink are possible
        if target == "rotate":
            target = "keep" if rng.random() < 0.5 else "shrink"
        return u if target == "keep" else -u
    if target == "keep":
        c = rng.uniform(c_ok + 0.02, 0.98)
    elif target == "rotate":
        c = rng.uniform(0.02, c_ok - 0.02)
    else:  # shrink
        c = rng.uniform(-0.98, -0.02)
    v = rng.normal(size=n)
    v = _unit(v - np.dot(v, u) * u)
    return c * u + math.sqrt(1.0 - c * c) * v


def _cosines_clear_of_thresholds(info, c_ok, c_bad):
    for c, b in zip(info["cosine"], info["branch"]):
        if b == ref.PASS:
            continue
        if min(abs(c - c_ok), abs(c), abs(c - c_bad)) < MARGIN:
            return False
    return True


def _random_delta(rng, m_before, scope, zero_leaf, c_ok):
    blocks = [[i] for i in range(N_LEAVES)] if scope == "leaf" else [list(range(N_LEAVES))]
    delta = [np.zeros(s) for s in LEAF_SHAPES]
    for blk in blocks:
        idx = [i for i in blk if i != zero_leaf]
        if not idx:
            continue
        m_vec = np.concatenate([np.ravel(m_before[i]) for i in idx])
        target = rng.choice(["keep", "rotate", "shrink"])
        rms = math.exp(rng.uniform(math.log(0.05), math.log(2.0)))
        vec = _block_direction(rng, m_vec, target, c_ok) * rms * math.sqrt(m_vec.size)
        pos = 0
        for i in idx:
            n = int(np.prod(LEAF_SHAPES[i], dtype=np.int64))
            delta[i] = vec[pos:pos + n].reshape(LEAF_SHAPES[i])
            pos += n
    return f32(delta)


HELOCO_DEFAULTS = dict(learning_rate=0.7, momentum=0.9, num_workers=None, weighting="constant",
                       keep_threshold=0.2, bad_threshold=-0.2, shrink_strength=0.5,
                       max_shrink=0.5, rotate_strength=1.0, confidence_scale=3.0, eps=1e-8,
                       rotate_schedule="normalized", weight_order="before", scope="leaf")


def _key(cfg):
    return tuple(sorted(cfg.items()))


def _seed_of(*parts):
    """A deterministic seed per config (Python's hash() is randomized per process)."""
    return 1 + sum(ord(ch) for ch in repr(parts)) % 997


@functools.lru_cache(maxsize=None)
def heloco_trajectory(cfg_key, seed):
    """Generate N_ARRIVALS arrivals for a HeLoCo config and the reference's results."""
    cfg = dict(cfg_key)
    rng = np.random.default_rng(seed)
    opt = ref.HeLoCo(**cfg).init(theta0(seed))
    theta = theta0(seed)
    out = dict(deltas=[], taus=[], d_in=[], m_before=[], thetas=[], moms=[],
               lookahead=[], infos=[], weights=[])
    c_ok = cfg["keep_threshold"]
    for t in range(N_ARRIVALS):
        tau = int(rng.integers(0, 8))
        rho = opt.rho(tau)
        m_before = [x.copy() for x in opt.m]
        for _attempt in range(100):
            if t in ZERO_ALL_STEPS:
                delta = [np.zeros(s) for s in LEAF_SHAPES]
            else:
                zl = LEAF_INDEX[ZERO_LEAF_STEPS[t]] if t in ZERO_LEAF_STEPS else None
                delta = _random_delta(rng, m_before, cfg["scope"], zl, c_ok)
            d_in = [rho * x for x in delta] if cfg["weight_order"] == "before" else delta
            _, info = ref.correct(d_in, m_before, scope=cfg["scope"],
                                  **{k: cfg[k] for k in ref.CORRECTION_KEYS})
            if _cosines_clear_of_thresholds(info, c_ok, cfg["bad_threshold"]):
                break
        else:
            raise AssertionError("could not draw an arrival clear of the thresholds")
        theta = opt.step(theta, delta, tau)
        out["deltas"].append(delta)
        out["taus"].append(tau)
        out["d_in"].append(d_in)
        out["m_before"].append(m_before)
        out["thetas"].append(theta)
        out["moms"].append([x.copy() for x in opt.m])
        out["lookahead"].append(opt.lookahead(theta))
        out["infos"].append(opt.info)
        out["weights"].append(opt.weight)
    return out


@functools.lru_cache(maxsize=None)
def plain_arrivals(seed, n=N_ARRIVALS):
    """Arrivals for the rules without correction: random Delta (some correlated with the
    previous one, so momentum builds up), one all-zero arrival, random staleness."""
    rng = np.random.default_rng(500 + seed)
    deltas, taus = [], []
    prev = [rng.normal(size=s) for s in LEAF_SHAPES]
    for t in range(n):
        if t == 9:
            d = [np.zeros(s) for s in LEAF_SHAPES]
        else:
            a = rng.uniform(-0.5, 1.0)
            d = [a * p + rng.normal(size=p.shape) * math.exp(rng.uniform(-2, 0.5)) for p in prev]
            prev = d
        deltas.append(f32(d))
        taus.append(int(rng.integers(0, 10)))
    return deltas, taus


# ---------------------------------------------------------------------------------------------
# library runners (one jit per config, reused)
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _jitted(kind, cfg_key):
    lib = _lib()
    cfg = dict(cfg_key)
    if kind == "heloco":
        tx = lib.heloco(**cfg)
    elif kind == "mla":
        tx = lib.mla(**cfg)
    elif kind == "async_nesterov":
        tx = lib.async_nesterov(**cfg)
    elif kind == "delayed_nesterov":
        tx = lib.delayed_nesterov(**cfg)
    elif kind == "cgad":
        tx = lib.cgad(**cfg)
    else:
        raise ValueError(kind)

    @jax.jit
    def step(params, state, grads, tau):
        updates, state = tx.update(grads, state, params, staleness=tau)
        return optax.apply_updates(params, updates), state

    return tx, jax.jit(tx.init), step


def run_library(kind, cfg, theta_init, deltas, taus, packed=False):
    """Yield (params, state) after each arrival; ``packed``: as a packed server runs the rule
    (θ, the state and Δ each in one buffer), yielded unpacked."""
    from heloco_jax.outer import packing  # pylint: disable=g-import-not-at-top
    _tx, init, step = _jitted(kind, _key(cfg))
    layout = packing.pack if packed else (lambda tree: tree)
    params = layout(to_jax(theta_init))
    state = init(params)
    for delta, tau in zip(deltas, taus):
        params, state = step(params, state, layout(to_jax(delta)), jnp.asarray(tau, jnp.int32))
        yield (packing.unpack(params), packing.unpack_all(state)) if packed else (params, state)


# ---------------------------------------------------------------------------------------------
# diagnostics comparison
# ---------------------------------------------------------------------------------------------
def _block_values(x, scope):
    """Per-block field of a library CorrectionInfo as a flat float64 array (leaf order).

    The library keeps one vector entry per block: per leaf in jax.tree.leaves
    order (scope "leaf"), or a single entry (scope "tree").
    """
    arr = np.asarray(x)
    assert arr.shape == ((TREEDEF.num_leaves,) if scope == "leaf" else (1,)), arr.shape
    return arr


def assert_info_matches(lib_info, ref_info, scope, what):
    assert isinstance(lib_info, hj.CorrectionInfo), type(lib_info)
    branch = _block_values(lib_info.branch, scope)
    assert np.issubdtype(branch.dtype, np.integer), branch.dtype
    np.testing.assert_array_equal(branch, np.array(ref_info["branch"]),
                                  err_msg=f"{what}: branch")
    for field in ("cosine", "confidence", "rotation", "shrinkage", "relative_correction"):
        got = _block_values(getattr(lib_info, field), scope).astype(np.float64)
        np.testing.assert_allclose(got, np.array(ref_info[field]), rtol=0, atol=DIAG_ATOL,
                                   err_msg=f"{what}: {field}")
    counts = np.asarray(lib_info.branch_counts)
    assert counts.shape == (4,), counts.shape
    np.testing.assert_array_equal(counts, ref_info["branch_counts"],
                                  err_msg=f"{what}: branch_counts")
    np.testing.assert_allclose(float(lib_info.total_relative_correction),
                               ref_info["total_relative_correction"], rtol=0, atol=DIAG_ATOL,
                               err_msg=f"{what}: total_relative_correction")


def branch_log(traj):
    counts = np.zeros(4, np.int64)
    for info in traj["infos"]:
        counts += info["branch_counts"]
    return counts


def assert_all_branches_exercised(traj, scope):
    counts = branch_log(traj)
    # pass: leaf scope -> all 4 leaves at step 0 + the zero leaves + the all-zero arrival;
    # tree scope -> step 0 and the all-zero arrival.
    need_pass = 2 if scope == "tree" else 3
    assert counts[ref.PASS] >= need_pass, counts
    for b in (ref.KEEP, ref.SHRINK, ref.ROTATE):
        assert counts[b] >= 3, (ref.BRANCH_NAMES[b], counts)
    for info in traj["infos"]:  # no cosine near a threshold (see MARGIN)
        assert _cosines_clear_of_thresholds(info, traj["c_ok"], traj["c_bad"])


# ---------------------------------------------------------------------------------------------
# HeLoCo: full product of schedule x weight order x scope x weighting
# ---------------------------------------------------------------------------------------------
def _heloco_cfg(**kw):
    cfg = dict(HELOCO_DEFAULTS)
    cfg.update(kw)
    return cfg


# Every schedule x weight order x scope combination (2^3 = 8), each with a weighting chosen so
# that every weighting meets both orders and both scopes, and "polynomial" (rho varies with
# the staleness, the case where the weight order matters) meets all four order x scope pairs.
# XLA compiles one HeLoCo step in ~0.5-1 s on a 2-core CPU, so the full 24-way product of
# schedule x order x scope x weighting is opt-in: HELOCO_FULL_SWEEP=1.
_COVER = [("normalized", "before", "leaf", "polynomial"),
          ("normalized", "before", "tree", "polynomial"),
          ("normalized", "after", "leaf", "polynomial"),
          ("normalized", "after", "tree", "constant"),
          ("eq14", "before", "leaf", "constant"),
          ("eq14", "before", "tree", "none"),
          ("eq14", "after", "leaf", "none"),
          ("eq14", "after", "tree", "polynomial")]
if os.environ.get("HELOCO_FULL_SWEEP"):
    _COVER = [(a, b, c, d) for a in ("normalized", "eq14") for b in ("before", "after")
              for c in ("leaf", "tree") for d in ("constant", "polynomial", "none")]
HELOCO_CASES = [pytest.param(_heloco_cfg(rotate_schedule=_sched, weight_order=_order,
                                         scope=_scope, num_workers=4, weighting=_w),
                             id=f"{_sched}-{_order}-{_scope}-{_w}")
                for _sched, _order, _scope, _w in _COVER]
# non-default hyper-parameters: lambda and beta hit their caps (k_d, k_s large), r(c) clipped
# at 1 (c_bad > 0 so that 0 <= c < c_bad rotates with r = 1), other kappa / eta / mu, and
# num_workers=None (rho = 1 whatever the weighting says).
_STRONG = dict(keep_threshold=0.35, bad_threshold=0.1, shrink_strength=3.0, max_shrink=0.3,
               rotate_strength=3.0, confidence_scale=1.5)
for _sched, _scope, _order in (("normalized", "leaf", "after"), ("eq14", "tree", "before")):
    HELOCO_CASES.append(pytest.param(
        _heloco_cfg(rotate_schedule=_sched, scope=_scope, num_workers=3,
                    weighting="polynomial", weight_order=_order, learning_rate=0.5,
                    momentum=0.8, **_STRONG),
        id=f"strong-{_sched}-{_scope}-{_order}"))
HELOCO_CASES.append(pytest.param(
    _heloco_cfg(num_workers=None, weighting="polynomial", weight_order="after"),
    id="noworkers-polynomial"))


def heloco_traj_for(cfg, seed):
    traj = heloco_trajectory(_key(cfg), seed)
    traj = dict(traj)
    traj["c_ok"] = cfg["keep_threshold"]
    traj["c_bad"] = cfg["bad_threshold"]
    return traj


# The server's packed layout (docs/ALGORITHMS.md, "Packed outer state"): per-leaf sums as row
# and segment sums, so the same tolerances hold; both scopes and both weight orders.
PACKED = [pytest.param(False, id="tree"), pytest.param(True, id="packed")]
HELOCO_PACKED_CASES = [HELOCO_CASES[i] for i in (0, 3, 8)]


@pytest.mark.parametrize("cfg", HELOCO_CASES)
def test_heloco_matches_reference(cfg, packed=False):
    """theta, momentum, look-ahead point, rho, count, staleness and the state's
    CorrectionInfo after every one of 40 arrivals."""
    lib = _lib()
    seed = _seed_of(_key(cfg))  # any seed works: arrivals near a threshold are redrawn
    traj = heloco_traj_for(cfg, seed)
    assert_all_branches_exercised(traj, cfg["scope"])
    sc = cfg["scope"]
    th_scale, m_scale = RunningScale(sc, theta0(seed)), RunningScale(sc)
    la_scale = RunningScale(sc, theta0(seed))
    for t, (params, state) in enumerate(run_library("heloco", cfg, theta0(seed),
                                                    traj["deltas"], traj["taus"], packed)):
        what = f"heloco step {t}"
        assert isinstance(state, lib.HeLoCoState), type(state)
        th_scale.check(to_np(params), traj["thetas"][t], what=what + " theta")
        assert all(np.asarray(x).dtype == np.float32
                   for x in jax.tree_util.tree_leaves(state.momentum))
        m_scale.check(to_np(state.momentum), traj["moms"][t], what=what + " momentum")
        la_scale.check(to_np(lib.lookahead_params(state, params)), traj["lookahead"][t],
                       what=what + " lookahead")
        np.testing.assert_allclose(float(state.weight), traj["weights"][t], rtol=WEIGHT_RTOL,
                                   err_msg=what + " weight")
        assert int(state.count) == t + 1, (what, int(state.count))
        assert int(state.staleness) == traj["taus"][t], (what, int(state.staleness))
        assert_info_matches(state.info, traj["infos"][t], cfg["scope"], what + " info")


@pytest.mark.parametrize("cfg", HELOCO_PACKED_CASES)
def test_packed_heloco_matches_reference(cfg):
    """The same, with θ and the state packed as the server packs them."""
    test_heloco_matches_reference(cfg, packed=True)


# ---------------------------------------------------------------------------------------------
# hj.heloco_correct on the same (d, m_b) pairs, bit-identical float32 inputs
# ---------------------------------------------------------------------------------------------
CORRECT_CASES = [
    pytest.param(_heloco_cfg(rotate_schedule="normalized", scope="leaf", num_workers=4,
                             weighting="polynomial"), id="normalized-leaf"),
    pytest.param(_heloco_cfg(rotate_schedule="eq14", scope="tree", num_workers=4,
                             weighting="polynomial", weight_order="after"), id="eq14-tree"),
    pytest.param(_heloco_cfg(rotate_schedule="eq14", scope="leaf", num_workers=3,
                             weighting="polynomial", weight_order="after", learning_rate=0.5,
                             momentum=0.8, **_STRONG), id="strong-eq14-leaf"),
    pytest.param(_heloco_cfg(rotate_schedule="normalized", scope="tree", num_workers=3,
                             weighting="polynomial", learning_rate=0.5, momentum=0.8,
                             **_STRONG), id="strong-normalized-tree"),
]


@functools.lru_cache(maxsize=None)
def _jitted_correct(corr_key):
    lib = _lib()
    kw = dict(corr_key)
    return jax.jit(lambda d, m: lib.heloco_correct(d, m, **kw))


@pytest.mark.parametrize("cfg", CORRECT_CASES)
def test_correct_matches_reference(cfg):
    """hj.heloco_correct(d, m_b) vs the reference for every arrival of a sequence (d as the
    correction saw it: rho*Delta or Delta by weight order; m_b the reference's momentum before
    the arrival, rounded to float32).  heloco_correct() must not apply rho."""
    seed = _seed_of(_key(cfg))
    traj = heloco_traj_for(cfg, seed)
    assert_all_branches_exercised(traj, cfg["scope"])
    kw = {k: cfg[k] for k in ref.CORRECTION_KEYS}
    kw["scope"] = cfg["scope"]
    fn = _jitted_correct(_key(kw))
    for t in range(N_ARRIVALS):
        d_in = f32(traj["d_in"][t])
        m_b = f32(traj["m_before"][t])
        d_hat_ref, info_ref = ref.correct(d_in, m_b, **kw)
        got, info = fn(to_jax(d_in), to_jax(m_b))
        what = f"correct step {t}"
        assert_leaves_close(to_np(got), d_hat_ref, rtol=CORRECT_RTOL,
                            atol_rel=CORRECT_ATOL_REL, what=what + " d_hat",
                            scope=cfg["scope"])
        assert_info_matches(info, info_ref, cfg["scope"], what)


def test_correct_hand_computed():
    """Four 2-D blocks whose corrections are worked out by hand from ALGORITHMS.md (defaults:
    c_ok=0.2, c_bad=-0.2, k_s=0.5, beta_max=0.5, k_d=1, kappa=3), checked against both the
    reference and the library."""
    lib = _lib()
    s = math.sqrt
    # block a: d=(3,4), m=(1,0): c=0.6 >= 0.2 -> keep
    # block b: d=(-1,1), m=(1,0): c=-1/sqrt2 -> shrink
    # block c: d=(1,7), m=(1,0): c=1/sqrt50 in [0, 0.2) -> rotate
    # block d: d=(0,0) -> pass
    d = {"a": np.array([3.0, 4.0]), "b": np.array([-1.0, 1.0]), "c": np.array([1.0, 7.0]),
         "d": np.array([0.0, 0.0])}
    m = {"a": np.array([1.0, 0.0]), "b": np.array([1.0, 0.0]), "c": np.array([1.0, 0.0]),
         "d": np.array([0.0, 2.0])}
    # shrink: conf = sqrt2/(sqrt2+3); beta = 0.5 * (1/sqrt2) * conf;
    #         d_hat = d - beta * c * |d| * m/|m| = (-1 + beta, 1)
    conf_b = s(2) / (s(2) + 3 + 1e-8)
    beta = 0.5 * (1 / s(2)) * conf_b
    exp_b = np.array([-1.0 + beta, 1.0])
    # rotate (normalized): r = (0.2 - c)/0.4, conf = sqrt50/(sqrt50+3), lam = r*conf;
    #         u = (1-lam) d/|d| + lam (1,0); d_hat = sqrt50 u/|u|
    c_c = 1 / s(50)
    conf_c = s(50) / (s(50) + 3 + 1e-8)
    lam = (0.2 - c_c) / 0.4 * conf_c
    u = (1 - lam) * d["c"] / s(50) + lam * np.array([1.0, 0.0])
    exp_c = s(50) * u / np.linalg.norm(u)
    expected = {"a": d["a"], "b": exp_b, "c": exp_c, "d": d["d"]}
    names = sorted(d)
    got_ref, info_ref = ref.correct([d[k] for k in names], [m[k] for k in names], scope="leaf")
    for k, g in zip(names, got_ref):
        np.testing.assert_allclose(g, expected[k], rtol=1e-12, atol=1e-12, err_msg=k)
    assert info_ref["branch"] == [ref.KEEP, ref.SHRINK, ref.ROTATE, ref.PASS]
    np.testing.assert_allclose(info_ref["shrinkage"][1], beta, rtol=1e-12)
    np.testing.assert_allclose(info_ref["rotation"][2], lam, rtol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(exp_c), s(50), rtol=1e-12)

    got, info = jax.jit(lib.heloco_correct)({k: jnp.asarray(v, jnp.float32) for k, v in d.items()},
                                     {k: jnp.asarray(v, jnp.float32) for k, v in m.items()})
    for k in names:
        np.testing.assert_allclose(np.asarray(got[k], np.float64), expected[k], rtol=1e-6,
                                   atol=1e-6, err_msg=k)
    block = {name: i for i, name in enumerate(hj.block_names(d))}
    assert sorted(block) == names
    np.testing.assert_array_equal([int(info.branch[block[k]]) for k in names], [1, 2, 3, 0])
    np.testing.assert_array_equal(np.asarray(info.branch_counts), [1, 1, 1, 1])
    np.testing.assert_allclose(float(info.shrinkage[block["b"]]), beta, rtol=1e-6)
    np.testing.assert_allclose(float(info.rotation[block["c"]]), lam, rtol=1e-6)
    for k in ("a", "d"):
        assert float(info.rotation[block[k]]) == 0.0 and float(info.shrinkage[block[k]]) == 0.0
    assert float(info.cosine[block["d"]]) == 0.0
    assert float(info.relative_correction[block["d"]]) == 0.0


def test_heloco_python_int_staleness():
    """staleness as a plain Python int (eager, un-jitted update) gives the same trajectory."""
    lib = _lib()
    cfg = _heloco_cfg(num_workers=4, weighting="polynomial", weight_order="after")
    seed = _seed_of(_key(cfg))
    traj = heloco_traj_for(cfg, seed)
    tx = lib.heloco(**cfg)
    params = to_jax(theta0(seed))
    state = tx.init(params)
    th_scale = RunningScale(cfg["scope"], theta0(seed))
    for t in range(3):
        updates, state = tx.update(to_jax(traj["deltas"][t]), state, params,
                                   staleness=traj["taus"][t])
        params = optax.apply_updates(params, updates)
        th_scale.check(to_np(params), traj["thetas"][t], what=f"eager step {t}")


# ---------------------------------------------------------------------------------------------
# MLA, async Nesterov, Delayed Nesterov
# ---------------------------------------------------------------------------------------------
WEIGHTINGS = [pytest.param(None, "constant", id="noworkers"),
              pytest.param(4, "constant", id="K4-constant"),
              pytest.param(5, "polynomial", id="K5-polynomial"),
              pytest.param(4, "none", id="K4-none")]


@pytest.mark.parametrize("num_workers,weighting", WEIGHTINGS)
def test_mla_matches_reference(num_workers, weighting, packed=False):
    lib = _lib()
    cfg = dict(learning_rate=0.7, momentum=0.9, num_workers=num_workers, weighting=weighting)
    seed = _seed_of("mla", num_workers, weighting)
    deltas, taus = plain_arrivals(seed)
    opt = ref.MLA(**cfg).init(theta0(seed))
    theta = theta0(seed)
    th_scale, m_scale = RunningScale("leaf", theta), RunningScale("leaf")
    la_scale = RunningScale("leaf", theta)
    for t, (params, state) in enumerate(run_library("mla", cfg, theta0(seed), deltas, taus,
                                                    packed)):
        theta = opt.step(theta, deltas[t], taus[t])
        what = f"mla step {t}"
        assert isinstance(state, lib.MLAState), type(state)
        th_scale.check(to_np(params), theta, what=what + " theta")
        m_scale.check(to_np(state.momentum), opt.m, what=what + " momentum")
        la_scale.check(to_np(lib.lookahead_params(state, params)), opt.lookahead(theta),
                       what=what + " lookahead")


@pytest.mark.parametrize("num_workers,weighting", WEIGHTINGS)
def test_async_nesterov_matches_reference(num_workers, weighting, packed=False):
    _lib()
    cfg = dict(learning_rate=0.07, momentum=0.9, num_workers=num_workers, weighting=weighting)
    seed = _seed_of("an", num_workers, weighting)
    deltas, taus = plain_arrivals(seed)
    opt = ref.AsyncNesterov(**cfg).init(theta0(seed))
    theta = theta0(seed)
    th_scale = RunningScale("leaf", theta)
    for t, (params, _state) in enumerate(
            run_library("async_nesterov", cfg, theta0(seed), deltas, taus, packed)):
        theta = opt.step(theta, deltas[t], taus[t])
        th_scale.check(to_np(params), theta, what=f"async_nesterov step {t} theta")


CGAD_CASES = [pytest.param(dict(decay=0.1, cutoff=32.0), id="defaults"),
              pytest.param(dict(decay=0.05, cutoff=6.0), id="cutoff-inside-the-taus"),
              pytest.param(dict(decay=0.3, cutoff=math.inf), id="adam-decay"),
              pytest.param(dict(decay=0.0, cutoff=math.inf, b2=0.95), id="adam")]


@pytest.mark.parametrize("gate", CGAD_CASES)
def test_cgad_matches_reference(gate, packed=False):
    """CGAD against the NumPy reference over 40 arrivals with τ in 0..9 (the cutoff case
    zeroes the ones from τ = 6 on: Adam then steps on its moments alone)."""
    _lib()
    cfg = dict(learning_rate=0.01, **gate)
    seed = _seed_of("cgad", sorted(gate.items()))
    deltas, taus = plain_arrivals(seed)
    opt = ref.CGAD(**cfg).init(theta0(seed))
    theta = theta0(seed)
    th_scale = RunningScale("leaf", theta)
    for t, (params, _state) in enumerate(run_library("cgad", cfg, theta0(seed), deltas, taus,
                                                     packed)):
        theta = opt.step(theta, deltas[t], taus[t])
        th_scale.check(to_np(params), theta, what=f"cgad step {t} theta")
    assert any(ref.age_gate(tau, gate["decay"], gate["cutoff"]) == 0 for tau in taus) == (
        gate["cutoff"] == 6.0)


DN_CASES = []
# N = 1 (must equal async Nesterov for any c) with c = 0 and c = 1/N = 1; larger N with c = 0,
# an interior c and c = 1/N (the largest allowed); 40 arrivals cover many flushes for each N.
for _n, _cs in ((1, (0.0, 1.0)), (2, (0.25, 0.5)), (3, (0.0, 1.0 / 3.0)), (5, (0.1, 0.2))):
    for _i, _c in enumerate(_cs):
        _K, _w = [(None, "constant"), (4, "polynomial"), (5, "constant"), (4, "none")][
            (_n + _i) % 4]
        DN_CASES.append(pytest.param(_n, _c, _K, _w, id=f"N{_n}-c{_c:.3f}-{_K}-{_w}"))


@pytest.mark.parametrize("buffer_size,c,num_workers,weighting", DN_CASES)
def test_delayed_nesterov_matches_reference(buffer_size, c, num_workers, weighting,
                                            packed=False):
    lib = _lib()
    cfg = dict(learning_rate=0.3, momentum=0.9, buffer_size=buffer_size, c=c,
               num_workers=num_workers, weighting=weighting)
    seed = _seed_of("dn", buffer_size, c, num_workers, weighting)
    deltas, taus = plain_arrivals(seed)
    opt = ref.DelayedNesterov(**cfg).init(theta0(seed))
    theta = theta0(seed)
    th_scale, m_scale = RunningScale("leaf", theta), RunningScale("leaf")
    for t, (params, state) in enumerate(
            run_library("delayed_nesterov", cfg, theta0(seed), deltas, taus, packed)):
        theta = opt.step(theta, deltas[t], taus[t])
        what = f"delayed_nesterov step {t}"
        assert isinstance(state, lib.DelayedNesterovState), type(state)
        th_scale.check(to_np(params), theta, what=what + " theta")
        m_scale.check(to_np(state.momentum), opt.m, what=what + " momentum")


def test_packed_rules_match_reference():
    """MLA, async Nesterov, Delayed Nesterov and CGAD with θ and the state packed as the server
    packs them (one case each), against the reference at the same tolerances."""
    test_mla_matches_reference(5, "polynomial", packed=True)
    test_async_nesterov_matches_reference(4, "constant", packed=True)
    test_delayed_nesterov_matches_reference(3, 1.0 / 3.0, 4, "polynomial", packed=True)
    test_cgad_matches_reference(dict(decay=0.05, cutoff=6.0), packed=True)


# ---------------------------------------------------------------------------------------------
# the reference itself: identities stated in ALGORITHMS.md (no library needed)
# ---------------------------------------------------------------------------------------------
def test_reference_identities():
    deltas, taus = plain_arrivals(3)
    th0 = theta0(3)

    # arrival weights
    assert ref.arrival_weight(None, "polynomial", 5) == 1.0
    assert ref.arrival_weight(4, "constant", 7) == 0.5
    assert ref.arrival_weight(4, "polynomial", 3) == 0.25
    assert ref.arrival_weight(4, "none", 3) == 1.0

    # DN with N = 1 is exactly the Nesterov rule, for any c
    for c in (0.0, 0.5, 1.0):
        an = ref.AsyncNesterov(0.3, 0.9, 4, "polynomial").init(th0)
        dn = ref.DelayedNesterov(0.3, 0.9, buffer_size=1, c=c, num_workers=4,
                                 weighting="polynomial").init(th0)
        a, b = th0, th0
        for d, tau in zip(deltas, taus):
            a, b = an.step(a, d, tau), dn.step(b, d, tau)
            for x, y in zip(a, b):
                np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12)

    # DN with c = 0 applies only g/N between flushes; momentum changes only every N arrivals
    dn = ref.DelayedNesterov(0.3, 0.9, buffer_size=3, c=0.0).init(th0)
    x = th0
    for i, d in enumerate(deltas[:9]):
        m_old = [y.copy() for y in dn.m]
        x_new = dn.step(x, d, 0)
        if (i + 1) % 3:
            for p, q, dd in zip(x_new, x, d):
                np.testing.assert_allclose(p, q - 0.3 * dd / 3, rtol=1e-12, atol=1e-12)
            for p, q in zip(dn.m, m_old):
                np.testing.assert_array_equal(p, q)
        x = x_new

    # HeLoCo with c_ok <= -1 never corrects: equals MLA (with look-ahead dispatch)
    for scope in ("leaf", "tree"):
        h = ref.HeLoCo(num_workers=4, weighting="polynomial", keep_threshold=-1.0,
                       scope=scope).init(th0)
        m = ref.MLA(0.7, 0.9, 4, "polynomial").init(th0)
        a, b = th0, th0
        for d, tau in zip(deltas, taus):
            a, b = h.step(a, d, tau), m.step(b, d, tau)
            for x, y in zip(a + h.lookahead(a), b + m.lookahead(b)):
                np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12)

    # first HeLoCo update (m = 0) equals MLA's
    h = ref.HeLoCo(num_workers=4).init(th0)
    m = ref.MLA(0.7, 0.9, 4).init(th0)
    for x, y in zip(h.step(th0, deltas[0], 2), m.step(th0, deltas[0], 2)):
        np.testing.assert_array_equal(x, y)
    assert list(h.info["branch_counts"]) == [N_LEAVES, 0, 0, 0]

    # rotate keeps the norm and raises the cosine; shrink lowers the norm and raises the cosine
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(300):
        d, mm = rng.normal(size=7), rng.normal(size=7)
        d = d + rng.uniform(-1, 1) * mm
        for sched in ("normalized", "eq14"):
            d_hat, info = ref.correct_block(d, mm, rotate_schedule=sched)
            seen.add(info.branch)
            cos_new = np.dot(d_hat, mm) / (np.linalg.norm(d_hat) * np.linalg.norm(mm))
            assert cos_new >= info.cosine - 1e-12
            if info.branch == ref.ROTATE:
                np.testing.assert_allclose(np.linalg.norm(d_hat), np.linalg.norm(d), rtol=1e-12)
                assert 0 < info.rotation <= 1
            elif info.branch == ref.SHRINK:
                assert np.linalg.norm(d_hat) <= np.linalg.norm(d) + 1e-12
                assert 0 < info.shrinkage <= 0.5
            else:
                np.testing.assert_array_equal(d_hat, d)
    assert seen == {ref.KEEP, ref.SHRINK, ref.ROTATE}

    # the weight order matters (conf differs) when rho != 1, and not when rho == 1
    cfg = _heloco_cfg(num_workers=4, weighting="polynomial")
    tr_b = heloco_trajectory(_key(dict(cfg, weight_order="before")), 11)
    opt_a = ref.HeLoCo(**dict(cfg, weight_order="after")).init(theta0(11))
    x = theta0(11)
    for d, tau in zip(tr_b["deltas"], tr_b["taus"]):
        x = opt_a.step(x, d, tau)
    assert max(float(np.max(np.abs(p - q))) for p, q in zip(x, tr_b["thetas"][-1])) > 1e-3
