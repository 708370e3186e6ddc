"""How accepted pseudo-gradients become the one update the outer rule sees
(docs/ALGORITHMS.md, "Aggregation").

One rule per run, ``hj.Syncer(aggregate=...)`` (config ``syncer.aggregate``), for a round's
workers, a syncer's group, or a single asynchronous arrival:

- ``mean()`` (the default): the (token-)weighted mean of the accepted, today's bits;
- ``trimmed_mean(f)``, ``median()``, ``centered_clip(tau, iters)``, ``norm_clip(bound)``:
  robust rules over peers (a round, or a group of a syncer with quorum > 1);
- ``screen(norm, cosine, ...)``: each single arrival against history (the norms of the
  arrivals accepted before it, and its cosine with the outer momentum): rejected or clipped.

Every factory returns a small frozen object; ``combine(rule, stacked, weights)`` applies a
peer rule, jitted, to arrivals stacked on axis 0 (a tree, or ``packing.Packed`` buffers: every
rule is elementwise or reads global norms, which a packed Δ's zero padding leaves unchanged).

>>> import jax.numpy as jnp
>>> import heloco_jax as hj
>>> rule = hj.aggregate.median()
>>> stacked = {"w": jnp.array([[1.0, 2.0], [3.0, -1.0], [100.0, 5.0]])}
>>> hj.aggregate.combine(rule, stacked, jnp.full(3, 1 / 3))["w"].tolist()
[3.0, 2.0]
>>> hj.aggregate.parse("trimmed_mean(f=1)")
trimmed_mean(f=1)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import re
from typing import Any, ClassVar, Literal, Optional, Sequence, get_args

import jax
import jax.numpy as jnp

Action = Literal["reject", "clip"]
ACTIONS: tuple[str, ...] = get_args(Action)


@dataclasses.dataclass(frozen=True)
class Aggregate:
  """A rule (one of the factories below). ``peers``: it combines several arrivals (refused on
  single asynchronous arrivals); ``weighted``: it reads token weights (else refused with
  ``hj.Syncer(weights="tokens")``); ``rounds``: allowed in synchronous rounds; ``history``: it
  reads the arrivals before (the server's ``history()``, which a checkpoint keeps)."""
  name: ClassVar[str] = ""
  peers: ClassVar[bool] = True
  weighted: ClassVar[bool] = True
  rounds: ClassVar[bool] = True
  history: ClassVar[bool] = False

  def __repr__(self) -> str:
    args = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
    return f"{self.name}({args})"

  def refusal(self, num_workers: int) -> Optional[tuple[str, object, str]]:
    """(argument, value, allowed) of the first argument not allowed with K workers, or None."""
    return None


def _positive(value: Any) -> bool:
  return (not isinstance(value, bool) and isinstance(value, numbers.Real) and value > 0
          and math.isfinite(value))


@dataclasses.dataclass(frozen=True, repr=False)
class Mean(Aggregate):
  """The (token-)weighted mean of the accepted: today's rule, bit for bit."""
  name: ClassVar[str] = "mean"
  peers: ClassVar[bool] = False


@dataclasses.dataclass(frozen=True, repr=False)
class TrimmedMean(Aggregate):
  """Per coordinate, the mean of the accepted after dropping the f largest and f smallest."""
  f: int = 1
  name: ClassVar[str] = "trimmed_mean"
  weighted: ClassVar[bool] = False

  def refusal(self, num_workers):
    if (isinstance(self.f, bool) or not isinstance(self.f, numbers.Integral) or self.f < 0
        or 2 * self.f >= num_workers):
      return "f", self.f, f"an integer in [0, K/2) (K = {num_workers} workers)"
    return None


@dataclasses.dataclass(frozen=True, repr=False)
class Median(Aggregate):
  """Per coordinate, the median of the accepted (the mean of the two middle values)."""
  name: ClassVar[str] = "median"
  weighted: ClassVar[bool] = False


@dataclasses.dataclass(frozen=True, repr=False)
class CenteredClip(Aggregate):
  """Centered clipping (Karimireddy et al. 2021), ``iters`` times from the median."""
  tau: float = 1.0
  iters: int = 3
  name: ClassVar[str] = "centered_clip"

  def refusal(self, num_workers):
    if not _positive(self.tau):
      return "tau", self.tau, "a finite number > 0"
    if isinstance(self.iters, bool) or not isinstance(self.iters, numbers.Integral) or (
        self.iters < 1):
      return "iters", self.iters, "an integer >= 1"
    return None


@dataclasses.dataclass(frozen=True, repr=False)
class NormClip(Aggregate):
  """Each Δ_i clipped to ``bound`` × the median norm of the accepted, then the mean."""
  bound: float = 2.0
  name: ClassVar[str] = "norm_clip"

  def refusal(self, num_workers):
    if not _positive(self.bound):
      return "bound", self.bound, "a finite number > 0"
    return None


@dataclasses.dataclass(frozen=True, repr=False)
class Screen(Aggregate):
  """Each asynchronous arrival against history, once ``warmup`` arrivals were accepted: its
  cosine with the outer momentum against ``cosine`` (None: not checked), then its norm against
  ``norm`` × the median of the last ``window`` accepted norms; ``action`` on a norm too large."""
  norm: Optional[float] = 3.0
  cosine: Optional[float] = None
  window: int = 16
  warmup: int = 4
  action: Action = "reject"
  name: ClassVar[str] = "screen"
  peers: ClassVar[bool] = False
  rounds: ClassVar[bool] = False
  history: ClassVar[bool] = True

  def refusal(self, num_workers):
    if self.norm is not None and not _positive(self.norm):
      return "norm", self.norm, "None or a finite number > 0"
    if self.cosine is not None and (isinstance(self.cosine, bool) or not isinstance(
        self.cosine, numbers.Real) or not -1 <= self.cosine <= 1):
      return "cosine", self.cosine, "None or a number in [-1, 1]"
    for name in ("window", "warmup"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        return name, value, "an integer >= 1"
    if self.warmup > self.window:
      return "warmup", self.warmup, f"an integer in [1, window={self.window}]"
    if self.action not in ACTIONS:
      return "action", self.action, "one of " + ", ".join(repr(a) for a in ACTIONS)
    return None

  def verdict(self, norm: float, cosine: Optional[float], history: Sequence[float]
              ) -> tuple[Optional[str], float]:
    """(the reason to reject, or None; the factor to scale the arrival by) of an arrival of
    ``norm`` and ``cosine`` (None: no momentum yet) after accepted norms ``history``."""
    recent = sorted(history[-self.window:])
    if len(recent) < self.warmup:  # no history yet: accepted
      return None, 1.0
    if self.cosine is not None and cosine is not None and cosine < self.cosine:
      return "cosine", 1.0
    if self.norm is None:
      return None, 1.0
    n = len(recent)
    limit = self.norm * 0.5 * (recent[(n - 1) // 2] + recent[n // 2])
    if norm <= limit:
      return None, 1.0
    return ("norm", 1.0) if self.action == "reject" else (None, limit / norm)


def mean() -> Mean:
  """The (token-)weighted mean of the accepted (the default; today's bits)."""
  return Mean()


def trimmed_mean(f: int = 1) -> TrimmedMean:
  """Coordinate-wise trimmed mean: drops the f largest and f smallest (0 ≤ f < K/2; in a
  group of n ≤ 2f arrivals, (n − 1)//2 each side)."""
  return TrimmedMean(f)


def median() -> Median:
  """Coordinate-wise median of the accepted."""
  return Median()


def centered_clip(tau: float = 1.0, iters: int = 3) -> CenteredClip:
  """Centered clipping (Karimireddy, He and Jaggi, ICML 2021), radius τ > 0, ``iters`` ≥ 1
  steps from the coordinate-wise median."""
  return CenteredClip(tau, iters)


def norm_clip(bound: float = 2.0) -> NormClip:
  """Each Δ_i scaled to at most ``bound`` × the median norm of the accepted; then the mean."""
  return NormClip(bound)


def screen(norm: Optional[float] = 3.0, cosine: Optional[float] = None, *, window: int = 16,
           warmup: int = 4, action: Action = "reject") -> Screen:
  """Screens each asynchronous arrival against history (ALGORITHMS.md, "Aggregation")."""
  return Screen(norm, cosine, window, warmup, action)


RULES = {cls.name: factory for cls, factory in (
    (Mean, mean), (TrimmedMean, trimmed_mean), (Median, median),
    (CenteredClip, centered_clip), (NormClip, norm_clip), (Screen, screen))}


def parse(text: str) -> Aggregate:
  """A rule from its repr, e.g. ``"median"``, ``"trimmed_mean(f=1)"`` or
  ``"screen(norm=3.0, cosine=-0.2)"`` (the CLI's ``syncer.aggregate``)."""
  found = re.fullmatch(r"\s*(\w+)\s*(?:\((.*)\))?\s*", str(text))
  if not found or found.group(1) not in RULES:
    raise ValueError(f"aggregate={text!r} is not allowed; allowed: one of "
                     + ", ".join(RULES) + ", with keyword arguments in parentheses")
  kwargs = {}
  for part in filter(None, (p.strip() for p in (found.group(2) or "").split(","))):
    key, sep, value = part.partition("=")
    if not sep:
      raise ValueError(f"aggregate={text!r} is not allowed; allowed: keyword arguments "
                       "(name=value)")
    value = value.strip().strip("'\"")
    kwargs[key.strip()] = (None if value == "None" else int(value)
                           if re.fullmatch(r"-?\d+", value) else _number(value))
  try:
    return RULES[found.group(1)](**kwargs)
  except TypeError as error:
    raise ValueError(f"aggregate={text!r} is not allowed; {error}") from None


def _number(value: str) -> Any:
  try:
    return float(value)
  except ValueError:
    return value


# ------------------------------------------------------------------ the mean (today's bits)

def accepted_mean(stacked: Any, accepted: jax.Array) -> Any:
  """The mean of the accepted rows of ``stacked`` (axis 0): a round's ends, or its received
  Δ_i. A rejected row may hold NaN: 0·NaN is NaN, so it is dropped first."""
  weights = accepted.astype(jnp.float32) / jnp.sum(accepted)
  def one(x):
    kept = jnp.where(accepted.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0)
    return jnp.tensordot(weights.astype(x.dtype), kept, axes=1)
  return jax.tree.map(one, stacked)


def weighted_sum(deltas: Sequence[Any], scales: Sequence[float]) -> Any:
  """Σ_j s_j·Δ_j with Python scalars s_j: a syncer group's mean (``OuterServer``)."""
  return jax.tree.map(lambda *xs: sum(s * x for s, x in zip(scales, xs)), *deltas)


# ------------------------------------------------------------------ the peer rules

def _rows(mask: jax.Array, x: jax.Array) -> jax.Array:
  return mask.reshape((-1,) + (1,) * (x.ndim - 1))


def row_norms(stacked: Any) -> jax.Array:
  """Per row (axis 0), the L2 norm over the whole tree, in float32."""
  leaves = jax.tree.leaves(stacked)
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)).reshape(x.shape[0], -1),
                              axis=1) for x in leaves))


def _ranked(x: jax.Array, keep: jax.Array) -> jax.Array:
  """``x`` sorted on axis 0 with the rows not kept last (+inf)."""
  return jnp.sort(jnp.where(_rows(keep, x), x, jnp.inf), axis=0)


def _median(x: jax.Array, keep: jax.Array) -> jax.Array:
  ranked, n = _ranked(x, keep), jnp.sum(keep)
  low = jnp.take(ranked, (n - 1) // 2, axis=0)
  high = jnp.take(ranked, n // 2, axis=0)
  return 0.5 * (low + high)


def _trimmed(x: jax.Array, keep: jax.Array, f: int) -> jax.Array:
  ranked, n = _ranked(x, keep), jnp.sum(keep)
  g = jnp.minimum(f, (n - 1) // 2)
  rank = jnp.arange(x.shape[0])
  inside = (rank >= g) & (rank < n - g)
  return jnp.sum(jnp.where(_rows(inside, x), ranked, 0), axis=0) / (n - 2 * g)


def _weighted(stacked: Any, scales: jax.Array) -> Any:
  return jax.tree.map(lambda x: jnp.sum(_rows(scales, x) * x, axis=0), stacked)


@functools.partial(jax.jit, static_argnums=0)
def combine(rule: Aggregate, stacked: Any, weights: jax.Array) -> Any:
  """``rule`` over the arrivals ``stacked`` on axis 0 with ``weights`` (≥ 0, summing to 1;
  0: excluded, its row may hold NaN). In float32 at least, cast back to Δ's dtypes
  (ALGORITHMS.md, "Aggregation")."""
  keep = weights > 0
  dtypes = jax.tree.map(lambda x: x.dtype, stacked)
  x = jax.tree.map(lambda v: jnp.where(_rows(keep, v), v, 0).astype(
      jnp.promote_types(v.dtype, jnp.float32)), stacked)
  w = weights.astype(jnp.float32)
  if isinstance(rule, Mean):
    out = _weighted(x, w)
  elif isinstance(rule, Median):
    out = jax.tree.map(lambda v: _median(v, keep), x)
  elif isinstance(rule, TrimmedMean):
    out = jax.tree.map(lambda v: _trimmed(v, keep, rule.f), x)
  elif isinstance(rule, NormClip):
    norms = row_norms(x)
    limit = rule.bound * _median(norms, keep)
    scale = jnp.where(norms > limit, limit / jnp.where(norms > 0, norms, 1.0), 1.0)
    out = _weighted(x, w * scale)
  elif isinstance(rule, CenteredClip):
    v = jax.tree.map(lambda y: _median(y, keep), x)
    for _ in range(rule.iters):
      diff = jax.tree.map(lambda y, c: y - c[None], x, v)
      norms = row_norms(diff)
      scale = jnp.minimum(1.0, rule.tau / jnp.where(norms > 0, norms, 1.0))
      v = jax.tree.map(lambda c, d: c + d, v, _weighted(diff, w * scale))
    out = v
  else:
    raise ValueError(f"aggregate={rule!r} is not allowed here; allowed: a rule over peers "
                     "(mean, trimmed_mean, median, centered_clip, norm_clip)")
  return jax.tree.map(lambda o, d: o.astype(d), out, dtypes)


@functools.partial(jax.jit, static_argnums=0)
def round_delta(rule: Aggregate, params: Any, ends: Any, accepted: jax.Array) -> Any:
  """A round's Δ with a robust ``rule``: ``combine`` of the accepted Δ_i = θ − end_i, equal
  weights (``mean()`` keeps the executors' θ − mean(end_i) instead: today's bits)."""
  deltas = jax.tree.map(lambda theta, end: theta[None] - end, params, ends)
  weights = accepted.astype(jnp.float32) / jnp.sum(accepted)
  return combine(rule, deltas, weights)


@jax.jit
def norm_and_cosine(delta: Any, momentum: Any) -> tuple[jax.Array, jax.Array]:
  """(‖Δ‖, cos(Δ, m)) over the whole tree in float32; cos 0 where m or Δ is 0."""
  dots = [jnp.vdot(d.astype(jnp.float32), m.astype(jnp.float32))
          for d, m in zip(jax.tree.leaves(delta), jax.tree.leaves(momentum))]
  d2 = sum(jnp.sum(jnp.square(d.astype(jnp.float32))) for d in jax.tree.leaves(delta))
  m2 = sum(jnp.sum(jnp.square(m.astype(jnp.float32))) for m in jax.tree.leaves(momentum))
  norms = jnp.sqrt(d2) * jnp.sqrt(m2)
  return jnp.sqrt(d2), jnp.where(norms > 0, sum(dots) / jnp.where(norms > 0, norms, 1.0), 0.0)


@jax.jit
def global_norm(delta: Any) -> jax.Array:
  return jnp.sqrt(sum(jnp.sum(jnp.square(d.astype(jnp.float32)))
                      for d in jax.tree.leaves(delta)))


@jax.jit
def scaled(delta: Any, factor: jax.Array) -> Any:
  """Δ·factor in Δ's dtypes (a screen's clip)."""
  return jax.tree.map(lambda d: (d * factor).astype(d.dtype), delta)
