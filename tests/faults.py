"""Fault injection for tests: a runtime whose executor poisons one worker's result.

``faulty(worker=1, arrival=2, value="nan")`` wraps a runtime factory (default:
the simulated one) so that worker 1's 2nd result carries a NaN in one
element: its 2nd pseudo-gradient (asynchronous methods) or its end
parameters in its 2nd round (synchronous ones). The engine must reject it
(``heloco_jax.training.rejection``). ``kill_worker`` (Ray) kills that worker's actor
at its ``arrival``-th dispatch result instead.

Production code knows nothing of this: it wraps ``Executor.run_worker`` and
``run_round`` from the outside.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from heloco_jax.runtime import factories
from heloco_jax.training import rejection


class FaultyExecutor:
  """``executor`` with worker ``worker``'s ``arrival``-th result poisoned with ``value``."""

  def __init__(self, executor: Any, worker: int, arrival: int, value: str,
               kill: bool = False):
    self._executor = executor
    self.worker, self.arrival, self.value, self.kill = worker, arrival, value, kill
    self.count = 0

  def __getattr__(self, name: str) -> Any:
    return getattr(self._executor, name)

  def _hit(self) -> bool:
    self.count += 1
    return self.count == self.arrival

  def run_worker(self, worker, previous, start, batches, key, carry=False):
    state, delta, loss = self._executor.run_worker(worker, previous, start, batches, key, carry)
    return state, self._fault(worker, delta), loss

  def run_fragment(self, worker, previous, steps, batches, key):
    state, delta, loss = self._executor.run_fragment(worker, previous, steps, batches, key)
    return state, self._fault(worker, delta), loss

  def _fault(self, worker, delta):
    """``delta``, poisoned (or its worker's actor killed) at the ``arrival``-th hit."""
    if worker == self.worker and self._hit():
      if self.kill:
        import ray  # pylint: disable=g-import-not-at-top
        ray.kill(self._executor.actor_of(worker), no_restart=False)
      else:
        delta = rejection.poison(self._executor.fetch(delta, "delta"), self.value)
    return delta

  def run_round(self, states, batches, keys, anchor):
    states, metrics = self._executor.run_round(states, batches, keys, anchor)
    if self._hit():
      states = states._replace(
          params=rejection.poison(states.params, self.value, worker=self.worker))
    return states, metrics


def faulty(worker: int, arrival: int = 1, value: str = "nan",
           runtime: Optional[factories.RuntimeFactory] = None,
           kill: bool = False) -> factories.RuntimeFactory:
  """``runtime`` (default: simulated) with worker ``worker``'s ``arrival``-th result poisoned
  (or, with ``kill``, its Ray actor killed)."""
  inner_factory = runtime or factories.simulated_runtime()

  def build(inner, spec):
    built = inner_factory(inner, spec)
    return dataclasses.replace(
        built, executor=FaultyExecutor(built.executor, worker, arrival, value, kill))
  return factories.RuntimeFactory(build, inner_factory.simulated_clock)

