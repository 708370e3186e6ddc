"""How the server groups and merges asynchronous arrivals (ALGORITHMS.md, "Syncer policies").

Decoupled DiLoCo (Douillard et al., arXiv 2604.21428) merges with a minimum quorum, a grace
window and token-weighted means. Here, per outer update:

  1. the group opens with the next arrival (at t₁) and takes arrivals in order until it has
     ``quorum`` of them, or until t₁ + ``timeout``, or until no other work is in flight; it
     closes then (at t_c: the quorum's last arrival, or t₁ + timeout);
  2. arrivals until t_c + w join it, w the grace window: ``grace_window``, or with
     ``adaptive_grace`` = κ > 0, κ·ḡ with ḡ an exponential moving average (decay
     ``GAP_DECAY``) of the gaps between consecutive arrivals seen so far;
  3. the group's Δ_j merge with weights ω_j: 1/|G| (``weights="mean"``) or n_j/Σn, n_j the
     tokens (units) arrival j trained on (``"tokens"``), as ρ(τ_max)·Δ = Σ_j ω_j·ρ(τ_j)·Δ_j.

Workers whose arrival waits in an open group are idle until it closes. The defaults (quorum
1, no grace, mean) are one update per arrival. ``aggregate`` chooses how the accepted merge
(``heloco_jax.training.aggregate``; rounds too), or how each single arrival is screened.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Literal, Optional, Sequence, get_args

from heloco_jax.training import aggregate as aggregate_lib

Weights = Literal["mean", "tokens"]
WEIGHTS: tuple[str, ...] = get_args(Weights)
GAP_DECAY = 0.9  # ḡ ← 0.9·ḡ + 0.1·gap (the first gap sets ḡ)


@dataclasses.dataclass(frozen=True)
class GroupRule:
  """One group's rule: its quorum q, timeout T and grace window w (seconds)."""
  quorum: int = 1
  timeout: float = math.inf
  window: float = 0.0

  def wants_more(self, size: int, first: float, at: float) -> bool:
    """Whether an arrival at ``at`` joins a group of ``size`` opened at ``first`` before it
    closes."""
    return size < self.quorum and at <= first + self.timeout

  def close(self, size: int, first: float, last: float, more_in_flight: bool) -> float:
    """When a group of ``size`` arrivals (first and last at ``first``, ``last``) closes."""
    if size >= self.quorum or not more_in_flight:
      return last
    return first + self.timeout

  def in_grace(self, closed: float, at: float) -> bool:
    """Whether an arrival at ``at`` joins a group closed at ``closed`` (its grace window)."""
    return self.window > 0 and at <= closed + self.window


@dataclasses.dataclass(frozen=True)
class Syncer:
  """The syncer policy of an asynchronous run (module docstring; ALGORITHMS.md).

  Attributes:
    quorum: q ≥ 1, arrivals a group waits for.
    timeout: seconds after a group's first arrival at which it closes short of q
      (``math.inf``: none).
    grace_window: w ≥ 0, seconds after a group closes within which arrivals join it.
    adaptive_grace: κ ≥ 0; > 0: w = κ·ḡ instead of ``grace_window``.
    weights: "mean" or "tokens".
    aggregate: how the accepted arrivals (a group's, or a round's) become one update, or
      how each arrival is screened (``hj.aggregate``; default ``hj.aggregate.mean()``).
  """
  quorum: int = 1
  timeout: float = math.inf
  grace_window: float = 0.0
  adaptive_grace: float = 0.0
  weights: Weights = "mean"
  aggregate: aggregate_lib.Aggregate = aggregate_lib.Mean()

  def refusal(self, num_workers: int) -> Optional[tuple[str, object, str]]:
    """(name, value, allowed) of the first setting that is not allowed, or None."""
    if (isinstance(self.quorum, bool) or not isinstance(self.quorum, numbers.Integral)
        or not 1 <= self.quorum <= num_workers):
      return "quorum", self.quorum, f"an integer in [1, {num_workers}] (num_workers)"
    for name, value in (("timeout", self.timeout), ("grace_window", self.grace_window),
                        ("adaptive_grace", self.adaptive_grace)):
      if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0 or (
          name != "timeout" and math.isinf(value)):
        return name, value, "a number >= 0" + (" or math.inf" if name == "timeout" else "")
    if self.timeout == 0 and self.quorum > 1:
      return "timeout", self.timeout, "a number > 0 with quorum > 1"
    if self.weights not in WEIGHTS:
      return "weights", self.weights, "one of " + ", ".join(repr(w) for w in WEIGHTS)
    return self.aggregate_refusal(num_workers, "async")

  def aggregate_refusal(self, num_workers: int, synchrony: str
                        ) -> Optional[tuple[str, object, str]]:
    """(name, value, allowed) when ``aggregate`` is not allowed with K workers and a method
    of ``synchrony`` ("async", "round", "step"), or None (ALGORITHMS.md, "Aggregation")."""
    rule = self.aggregate
    if not isinstance(rule, aggregate_lib.Aggregate):
      return "aggregate", rule, "an hj.aggregate rule (" + ", ".join(aggregate_lib.RULES) + ")"
    if synchrony == "step" and not isinstance(rule, aggregate_lib.Mean):
      return "aggregate", rule, "hj.aggregate.mean() with DDP (it averages gradients)"
    if synchrony == "round" and not rule.rounds:
      return "aggregate", rule, ("a rule over peers in synchronous rounds (mean, trimmed_mean, "
                                 "median, centered_clip, norm_clip); screen is for "
                                 "asynchronous arrivals")
    if synchrony == "async" and rule.peers and not self.groups:
      return "aggregate", rule, ("mean() or screen(...) on single arrivals (quorum=1, no grace "
                                 f"window): {rule.name} needs peers, e.g. quorum >= 3")
    if self.weights == "tokens" and not rule.weighted:
      return "aggregate", rule, f"a token-weighted rule with weights='tokens' ({rule.name} is not)"
    # K: a round's workers, or a group's quorum (its size unless a grace window adds more)
    peers = num_workers if synchrony != "async" or self.grace_window > 0 or (
        self.adaptive_grace > 0) else self.quorum
    refused = rule.refusal(peers)
    if refused:
      name, value, allowed = refused
      return f"aggregate.{name}", value, allowed
    return None

  @property
  def groups(self) -> bool:
    """Whether arrivals may be merged (anything but one update per arrival)."""
    return self.quorum > 1 or self.grace_window > 0 or self.adaptive_grace > 0

  def rule(self, mean_gap: Optional[float]) -> GroupRule:
    """The next group's rule, given ḡ (None before two arrivals: no adaptive window yet)."""
    window = self.grace_window
    if self.adaptive_grace > 0:
      window = 0.0 if mean_gap is None else self.adaptive_grace * mean_gap
    return GroupRule(self.quorum, self.timeout, window)

  def merge_weights(self, tokens: Sequence[int]) -> list[float]:
    """ω_j of a group whose arrivals trained on ``tokens``: each |G|/Σn·n_j for "tokens" and
    1 for "mean", so that the merge divides by |G| either way (a group of equal n_j is the
    mean bit for bit)."""
    if self.weights == "mean":
      return [1.0] * len(tokens)
    total = sum(tokens)
    return [len(tokens) * n / total for n in tokens]


def update_gap(mean_gap: Optional[float], last: Optional[float], arrivals: Sequence[float]
               ) -> tuple[Optional[float], Optional[float]]:
  """(ḡ, the last arrival time) after a group's arrivals at ``arrivals`` (in order)."""
  for at in arrivals:
    if last is not None:
      gap = at - last
      mean_gap = gap if mean_gap is None else GAP_DECAY * mean_gap + (1 - GAP_DECAY) * gap
    last = at
  return mean_gap, last


@dataclasses.dataclass
class SyncerState:
  """The adaptive grace window's memory (a checkpoint's "syncer" entry): ḡ, the mean gap
  between arrivals, and the last arrival's time."""
  mean_gap: Optional[float] = None
  last_arrival: Optional[float] = None

  def arrived(self, times: Sequence[float]) -> None:
    """A group's arrivals at ``times`` (in order): ``update_gap``."""
    self.mean_gap, self.last_arrival = update_gap(self.mean_gap, self.last_arrival, times)
