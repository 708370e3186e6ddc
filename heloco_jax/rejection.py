"""The one rejection policy: a pseudo-gradient with a NaN or Inf never reaches θ.

Every runtime and both loops (asynchronous arrivals, synchronous rounds) ask
``reasons`` which pseudo-gradients to reject; a rejected worker restarts with
a fresh inner optimizer state (its step count kept). ``poison`` injects such
a pseudo-gradient for the fault tests (``fault.*`` keys).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np


class DivergenceError(RuntimeError):
  """A run cannot go on: every worker's work is non-finite, or the evaluation is."""


def poison(tree: Any, value: str, worker: Optional[int] = None) -> Any:
  """``tree`` with its first leaf's first element (of ``worker``'s slice) set to NaN or Inf."""
  leaves, treedef = jax.tree.flatten(tree)
  index = (0,) * leaves[0].ndim if worker is None else (worker,) + (0,) * (leaves[0].ndim - 1)
  leaves[0] = jnp.asarray(leaves[0]).at[index].set(jnp.nan if value == "nan" else jnp.inf)
  return jax.tree.unflatten(treedef, leaves)


@functools.partial(jax.jit, static_argnames="per_worker")
def nonfinite(tree: Any, per_worker: bool = False) -> tuple[jax.Array, jax.Array]:
  """(has NaN, has ±Inf) over ``tree``; per slice of the leading axis if ``per_worker``."""
  def any_of(test):
    flags = [test(x).reshape((x.shape[0], -1) if per_worker else (-1,)).any(axis=-1)
             for x in jax.tree.leaves(tree)]
    return jnp.any(jnp.stack(flags), axis=0)
  return any_of(jnp.isnan), any_of(jnp.isinf)


def reasons(has_nan: Any, has_inf: Any) -> list[Optional[str]]:
  """Per pseudo-gradient: None if finite, else "nan" or "inf"."""
  has_nan, has_inf = np.atleast_1d(has_nan), np.atleast_1d(has_inf)
  return ["nan" if n else "inf" if i else None for n, i in zip(has_nan, has_inf)]


def screen(deltas: list[Any]) -> list[Optional[str]]:
  """Per pseudo-gradient of an arrival group: its rejection reason (one host read)."""
  return [reasons(*flags)[0] for flags in jax.device_get([nonfinite(d) for d in deltas])]


class RejectionStreak:
  """Stops a run whose workers keep sending non-finite work (docs/DESIGN.md, "Faults").

  A rejected worker restarts from θ with a fresh optimizer state; when that
  fails too, the run diverges. So the run stops after 2·K rejections in a row
  with no update applied between them (asynchronous arrivals, or two rounds
  in which every worker was rejected), and at its end if every arrival was
  rejected (``check_end``).
  """

  def __init__(self, num_workers: int):
    self.num_workers = num_workers
    self.count = 0
    self.kinds: set[str] = set()

  def update(self, rejected: list[Optional[str]]) -> None:
    """Counts a group's reasons; raises ``DivergenceError`` when the streak is complete."""
    if any(reason is None for reason in rejected):
      self.count = 0
      return
    self.count += len(rejected)
    self.kinds.update(rejected)
    if self.count >= 2 * self.num_workers:
      raise DivergenceError(self._message(f"the last {self.count} pseudo-gradients"))

  def check_end(self, applied_updates: int) -> None:
    """Raises ``DivergenceError`` when a run ends with rejections and no update applied."""
    if applied_updates == 0 and self.count > 0:
      raise DivergenceError(self._message(f"all {self.count} pseudo-gradients of the run"))

  def _message(self, which: str) -> str:
    return (f"{which} were non-finite ({', '.join(sorted(self.kinds)) or 'nan or inf'}) and were "
            "rejected: "
            "the inner optimization diverges (e.g. the inner learning rate is too high, or the "
            "data hold values the model cannot take, such as a token id outside the "
            "vocabulary)")
