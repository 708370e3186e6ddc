"""Workers that leave and join a run: a failure schedule (docs/FAILURES.md; ALGORITHMS.md,
"Elastic membership"), in seconds of the run's clock, simulated or real.

A ``Membership`` lists, per worker, the intervals [leave, back) in which it is away: a crash
or preemption at ``leave``, a recovery (or a scale-up) at ``back`` (``math.inf``: it never
comes back). A worker away from t = 0 is a new worker that joins at ``back``, with its own
data stream. The rules, applied by the asynchronous loop (``runtime.elastic``):

  * a worker whose dispatch would arrive after it leaves loses that dispatch whole: its
    tokens count as dropped (``tokens_dropped``), it never reaches the server;
  * a worker that comes back (or joins) is dispatched at ``back`` from the server's dispatch
    point (θ, or its look-ahead point), keeping its own step count; with fragments it starts
    again from all of θ;
  * every dispatched token is applied, rejected, dropped, or still in flight when the budget
    ends (never computed on the simulated clock).

Synchronous methods run elastic rounds and DDP steps (``runtime.elastic``): a round or step
takes the workers present at its start; one that leaves before it ends loses its part of
it (dropped), the others' parts are averaged; one that comes back joins at the next start.
On a real clock the same rules read the clock: an asynchronous dispatch is lost when its
worker leaves first (the arrival queue takes it then), and DDP's chunks are cut at an event
by the fastest step timed (``RealClock.plan_ddp``). ``Membership.refusal`` says which
schedules do not fit a run.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional, Sequence

import numpy as np


Absence = tuple[int, float, float]  # (worker, leave, back)


@dataclasses.dataclass(frozen=True)
class Membership:
  """A failure schedule: per worker, the intervals in which it is away.

  Attributes:
    absences: (worker, leave, back) triples, ``leave < back``; ``back`` may be ``math.inf``.
      A worker's intervals must not overlap.
  """
  absences: tuple[Absence, ...] = ()

  def refusal(self, num_workers: int) -> Optional[str]:
    """Why the schedule does not fit ``num_workers`` workers, or None."""
    by_worker: dict[int, list[tuple[float, float]]] = {}
    for worker, leave, back in self.absences:
      if (isinstance(worker, bool)
          or not (isinstance(worker, (int, np.integer)) and 0 <= worker < num_workers)):
        return f"worker {worker!r} is not one of the {num_workers} workers"
      if not all(isinstance(x, (int, float, np.integer, np.floating))
                 and not isinstance(x, bool) for x in (leave, back)):
        return (f"worker {worker}: leave={leave!r}, back={back!r}; allowed: numbers of "
                "seconds, 0 <= leave < back (back may be math.inf)")
      if not (0 <= leave < back) or math.isnan(back):
        return f"worker {worker}: leave={leave!r}, back={back!r}; allowed: 0 <= leave < back"
      by_worker.setdefault(int(worker), []).append((leave, back))
    for worker, spans in by_worker.items():
      spans.sort()
      if any(b > l2 for (_, b), (l2, _) in zip(spans, spans[1:])):
        return f"worker {worker}'s absences overlap"
    if len([w for w, spans in by_worker.items() if spans[0][0] == 0]) == num_workers:
      return "every worker is away at the start"
    return None

  def away(self, worker: int, t: float) -> Optional[float]:
    """When ``worker``, away at ``t``, comes back (``math.inf``: never); None when present."""
    return next((back for w, leave, back in self.absences if w == worker and leave <= t < back),
                None)

  def everyone_gone(self, num_workers: int) -> Optional[float]:
    """When the last of ``num_workers`` workers leaves for good, if every one does (none
    comes back); else None."""
    final = {w: leave for w, leave, back in self.absences if back == math.inf}
    if len(final) < num_workers:
      return None
    return float(max(final.values()))

  def next_leave(self, worker: int, t: float) -> float:
    """The first time after ``t`` at which ``worker`` leaves (``math.inf``: never)."""
    return min((leave for w, leave, _ in self.absences if w == worker and leave > t),
               default=math.inf)

  def present(self, num_workers: int, t: float) -> np.ndarray:
    """Which of ``num_workers`` workers are present at ``t`` (booleans)."""
    return np.array([self.away(w, t) is None for w in range(num_workers)])

  def lost(self, present: np.ndarray, start: float, end: float) -> np.ndarray:
    """Which of the ``present`` workers (booleans) leave after ``start`` and before ``end``:
    they lose their part of a round or step that runs from ``start`` to ``end``."""
    return present & np.array([self.next_leave(i, start) < end for i in range(len(present))])

  def events(self, start: float, end: float) -> list[tuple[float, int, str]]:
    """(time, worker, "left" | "joined") of the departures in [start, end) and the returns
    in (start, end], in time order (a synchronous loop's rows between two barriers); a new
    worker, away from t = 0, only joins."""
    events = [(leave, w, "left") for w, leave, _ in self.absences
              if start <= leave < end and leave > 0]
    events += [(back, w, "joined") for w, _, back in self.absences if start < back <= end]
    return sorted(events)

  @classmethod
  def parse(cls, text: str) -> "Membership":
    """``"1@30-60,2@40,4@0-50"``: worker 1 away from 30 to 60, worker 2 from 40 on, worker 4
    (a new worker) joins at 50. '' is no failures.

    Raises:
      ValueError: a part that is not ``WORKER@LEAVE`` or ``WORKER@LEAVE-BACK``.
    """
    absences = []
    for part in filter(None, (p.strip() for p in text.split(","))):
      match = re.fullmatch(r"(\d+)@([0-9.eE+]+)(?:-([0-9.eE+]+))?", part)
      if not match:
        raise ValueError(f"{part!r}; allowed: WORKER@LEAVE or WORKER@LEAVE-BACK (seconds), "
                         "comma-separated, e.g. '1@30-60,2@40'")
      worker, leave, back = match.groups()
      absences.append((int(worker), float(leave), math.inf if back is None else float(back)))
    return cls(tuple(absences))

  @classmethod
  def random(cls, num_workers: int, *, rate: float, downtime: float, horizon: float,
             seed: int, workers: Optional[Sequence[int]] = None) -> "Membership":
    """A seeded schedule: each worker (of ``workers``, default all) fails at the times of a
    Poisson process of ``rate`` failures per second up to ``horizon`` and is away an
    exponential time of mean ``downtime`` each time."""
    rng = np.random.default_rng(seed)
    absences = []
    for worker in (range(num_workers) if workers is None else workers):
      t = float(rng.exponential(1 / rate)) if rate > 0 else math.inf
      while t < horizon:
        back = t + float(rng.exponential(downtime))
        if not back > t:  # a downtime below the clock's resolution at t
          raise ValueError(f"downtime={downtime!r} is too short for the simulated clock: a "
                           f"failure at {t:g} s would end at the same second; allowed: a "
                           "downtime of at least a millionth of the run's seconds")
        absences.append((int(worker), t, back))
        t = back + float(rng.exponential(1 / rate))
    return cls(tuple(absences))


@dataclasses.dataclass
class MembershipState:
  """Where membership stands in a run (a checkpoint's "membership" entry): per worker away
  or about to leave, [time, "leave" | "join", the units of the dispatch it loses]; the units
  every dispatch held, and those lost to departures."""
  away: dict = dataclasses.field(default_factory=dict)
  dispatched_units: int = 0
  dropped_units: int = 0

  def restored(self) -> None:
    self.away = {int(w): event for w, event in self.away.items()}  # JSON keys are strings
