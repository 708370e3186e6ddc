"""Elastic membership in the engine's loops (ALGORITHMS.md, "Elastic membership";
docs/FAILURES.md): the component each loop calls when a failure schedule
(``hj.Membership``, ``heloco_jax.training.membership``) takes workers away and brings them
back. A run without one never calls it (docs/DESIGN.md, "The engine").

  * ``AsyncMembership``: the asynchronous loop's. A worker away at its dispatch waits for its
    return in the arrival queue; a dispatch its worker leaves before finishing is lost whole
    (its units dropped); membership events are entries of the same queue, in time order with
    the arrivals.
  * ``present``, ``barrier_rows``, ``ddp_until_an_event``: the synchronous loops'. A round or
    a DDP step takes the workers present at its start; one that leaves before its end loses
    its part.

Where membership stands (who is away, the units dispatched and dropped) is the run's
``MembershipState`` (``run.features.membership``), which a checkpoint keeps.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import numpy as np

from heloco_jax.runtime import base
from heloco_jax.runtime.base import Job
from heloco_jax.runtime.state import Run


class AsyncMembership:
  """The failure schedule of an asynchronous run, applied through its arrival ``queue``;
  ``dispatch(worker, now)`` is the loop's, called when a worker comes back."""

  def __init__(self, run: Run, queue: base.Arrivals,
               dispatch: Callable[[int, float], None]) -> None:
    self.run, self.queue, self.dispatch = run, queue, dispatch
    self.schedule = run.spec.membership
    self.state = run.features.membership
    self.away = self.state.away  # per worker away or about to leave: [time, kind, dropped]
    self.events = base.Events(lambda w: w in self.away,
                              lambda w: w not in self.away or self.away[w][1] == "join",
                              self._event_in_a_group)
    # Fragments: x̂ is the anchor (streaming.py), no compressed download to forget.
    self.downlink = None if run.spec.streaming else run.downlink

  def restore(self) -> None:
    """Queues the membership events a checkpoint kept."""
    for worker, (at, _, _) in sorted(self.away.items()):
      self.queue.push(worker, Job(None, 0, 0, at))

  def away_at_dispatch(self, worker: int, now: float) -> bool:
    """True when ``worker`` is away at its dispatch: its return is queued instead (it left as
    its work arrived: nothing lost; a new worker has nothing to leave)."""
    back = self.schedule.away(worker, now)
    if back is None:
      return False
    if self.downlink is not None:  # it comes back holding nothing of θ
      self.run.features.downlink.forget(worker)
    if now > 0:
      self.run.emit(row(self.run, "left", worker, now, dropped=0))
    self.expect(worker, back, "join")
    return True

  def next_leave(self, worker: int, now: float) -> float:
    """When ``worker``, dispatched at ``now``, leaves next (``math.inf``: never)."""
    return self.schedule.next_leave(worker, now)

  def leaves(self, worker: int) -> float:
    """When ``worker`` leaves after the dispatch of its job in flight, on a real clock (whose
    job holds its dispatch time as its ``finish``: the clock learns the finish as it comes)."""
    return self.schedule.next_leave(worker, self.run.state.jobs[worker].finish)

  def lost_to_leave(self, worker: int, at: float) -> None:
    """``worker`` leaves at ``at``, before its dispatch in flight finishes: the dispatch is
    lost, never computed, and the departure queued."""
    self.expect(worker, at, "leave", self.lose(worker))

  def without_leavers(self, group: list[int], times: list[float]
                      ) -> tuple[list[int], list[float]]:
    """A real clock's arrival group less the workers that left before their arrival (taken
    when they left, FAILURES.md: their dispatches lost)."""
    s = self.run.state
    for w, at in [(w, at) for w, at in zip(group, times) if self.leaves(w) <= at]:
      s.sim_time = at
      self.left(w, at, self.lose(w))
    kept = [(w, at) for w, at in zip(group, times) if w in s.jobs]
    return [w for w, _ in kept], [at for _, at in kept]

  def event(self, worker: int, now: float) -> None:
    """The membership event of ``worker`` at the head of the queue: a departure or a return."""
    _, kind, dropped = self.away.pop(worker)
    if kind == "leave":
      self.left(worker, now, dropped)
    else:
      self.joined(worker, now)

  def lose(self, worker: int) -> int:
    """``worker``'s dispatch in flight is lost (it leaves first): the units it held."""
    f = self.run.features
    if self.run.spec.streaming:  # it comes back to θ as a whole (FAILURES.md)
      f.streaming.restart(worker)
    if self.downlink is not None:
      f.downlink.forget(worker)
    return self.run.state.jobs.pop(worker).units

  def expect(self, worker: int, at: float, kind: str, dropped: int = 0) -> None:
    """A membership event of ``worker`` at ``at`` in the arrival queue ("leave": with the
    units its lost dispatch held; "join"); none for a worker that never comes back."""
    if math.isfinite(at):
      self.away[worker] = [at, kind, dropped]
      self.queue.push(worker, Job(None, 0, 0, at))

  def left(self, worker: int, now: float, dropped: int) -> None:
    self.state.dropped_units += dropped
    self.run.emit(row(self.run, "left", worker, now, dropped))
    back = self.schedule.away(worker, now)
    if back is None:  # back already: a real clock took the loss after the absence ended
      self.joined(worker, now)
    else:
      self.expect(worker, back, "join")

  def joined(self, worker: int, now: float) -> None:
    self.run.emit(row(self.run, "joined", worker, now))
    self.dispatch(worker, now)

  def _event_in_a_group(self, worker: int, at: float) -> None:
    self.run.state.sim_time = at
    self.event(worker, at)


async def present(run: Run) -> Optional[np.ndarray]:
  """The workers present at a synchronous loop's next barrier. With every one away, the clock
  first moves to (the real clock: waits for) the first return, its rows written; None when
  none comes back within the budget."""
  s, spec = run.state, run.spec
  while not (here := spec.membership.present(spec.num_workers, s.sim_time)).any():
    back = min(spec.membership.away(i, s.sim_time) for i in range(spec.num_workers))
    if not math.isfinite(back) or spec.budget.over(s.units, back):
      return None
    none = np.zeros(spec.num_workers, bool)
    barrier_rows(run, s.sim_time, back, np.zeros(spec.num_workers, int), none, none)
    await run.clock.wait_until(back)
    s.sim_time = back
  return here


def barrier_rows(run: Run, start: float, end: float, real_steps: np.ndarray,
                 here: np.ndarray, lost: np.ndarray) -> None:
  """The ``left`` and ``joined`` rows between a synchronous loop's barriers at ``start`` and
  ``end``; a worker ``lost`` from the round or step counts its ``real_steps`` as dropped."""
  spec, membership = run.spec, run.features.membership
  membership.dispatched_units += int(real_steps[here].sum()) * spec.units_per_step
  membership.dropped_units += int(real_steps[lost].sum()) * spec.units_per_step
  dropped = set()
  for at, worker, kind in spec.membership.events(start, end):
    units = None
    if kind == "left":
      first = lost[worker] and worker not in dropped
      units = int(real_steps[worker]) * spec.units_per_step * first
      dropped.add(worker)
    run.emit(row(run, kind, worker, at, units))


def row(run: Run, kind: str, worker: int, at: float,
        dropped: Optional[int] = None) -> dict[str, Any]:
  """A ``left`` (with the units its lost work held) or ``joined`` row (DESIGN.md,
  "metrics.jsonl"), one key order for every loop."""
  fields = {"event": kind, "worker": worker, "sim_time": at}
  if dropped is not None:
    fields["dropped_" + run.spec.unit] = dropped
  return {**fields, "outer_updates": run.state.version}


def ddp_until_an_event(run: Run, here: np.ndarray, planned: list
                       ) -> tuple[int, list, np.ndarray]:
  """A DDP chunk cut at the next membership event (ALGORITHMS.md, "Elastic membership"):
  (steps, their plan, the workers lost). The steps that end by the event run as planned (the
  largest power of two of them; the rest in the next chunks); a step in which a worker
  leaves runs alone, without it (its part dropped); a worker that comes back joins at the
  next step's start."""
  s, membership = run.state, run.spec.membership
  t, k = s.sim_time, run.spec.num_workers
  event = min(membership.next_leave(i, t) if here[i] else membership.away(i, t)
              for i in range(k))
  ends = t + np.cumsum([seconds for seconds, _ in planned])
  steps = int(np.sum(ends <= event))
  if steps == len(planned):
    return steps, planned, np.zeros(k, bool)
  if steps:  # a power of two: cut chunks compile a few scan lengths, not one per length
    steps = 1 << (steps.bit_length() - 1)
    return steps, planned[:steps], np.zeros(k, bool)
  return 1, planned[:1], membership.lost(here, t, ends[0])
