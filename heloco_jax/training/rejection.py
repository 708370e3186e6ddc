"""The one rejection policy: a pseudo-gradient with a NaN or Inf never reaches θ, nor one an
aggregation screen refuses (``hj.aggregate.screen``: reasons "norm" and "cosine").

Every runtime and both loops (asynchronous arrivals, synchronous rounds) ask
``reasons`` which pseudo-gradients to reject; a rejected worker restarts with
a fresh inner optimizer state (its step count kept). ``poison`` injects such
a pseudo-gradient for the fault tests (``tests/faults.py``).
"""

from __future__ import annotations

import dataclasses
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


def default_limit(num_workers: int) -> int:
  """The rejection limit when none is set: K rejections in a row, at least 2."""
  return max(2, num_workers)


def _no_streak() -> dict[str, Any]:
  return {"count": 0, "kinds": [], "workers": []}


@dataclasses.dataclass
class RejectionState:
  """The rejection policy's state (a checkpoint's "rejection" entry; docs/DESIGN.md, "Faults").

  It counts the pseudo-gradients rejected and the units they held, and stops a
  run whose workers keep sending non-finite work. A rejected worker restarts
  from θ with a fresh optimizer state; when that fails too, the run diverges.
  So the run stops once ``limit`` pseudo-gradients in a row were rejected with
  no update applied between them (asynchronous arrivals, or whole rounds in
  which every worker was rejected), and at its end if every arrival was
  rejected (``check_end``).

  Attributes:
    rejected: pseudo-gradients rejected.
    rejected_units: the units they held.
    rejected_by: per reason ("nan", "inf", "norm", "cosine"), the pseudo-gradients rejected.
    rejected_in_a_row: the streak since the last applied update: its ``count``, the
      ``kinds`` ("nan", "inf") and the ``workers`` that sent them.
    limit: rejections in a row that stop the run (the engine's, from
      ``RunSpec.rejection_limit`` or ``default_limit(K)``; a setting, not saved).
  """
  rejected: int = 0
  rejected_units: int = 0
  rejected_in_a_row: Any = dataclasses.field(default_factory=_no_streak)
  rejected_by: dict[str, int] = dataclasses.field(default_factory=dict)
  limit: int = dataclasses.field(default=2, metadata={"setting": True})

  def restored(self) -> None:
    if isinstance(self.rejected_in_a_row, int):  # checkpoints that kept the count only
      self.rejected_in_a_row = {**_no_streak(), "count": self.rejected_in_a_row}

  def reject(self, units: int, reason: Optional[str] = None) -> None:
    self.rejected += 1
    self.rejected_units += units
    if reason is not None:
      self.rejected_by[reason] = self.rejected_by.get(reason, 0) + 1

  def update(self, rejected: list[Optional[str]], workers: Optional[list[int]] = None) -> None:
    """Counts a group's reasons (of ``workers``, default 0..n-1); raises
    ``DivergenceError`` when the streak reaches the limit."""
    if any(reason is None for reason in rejected):
      self.rejected_in_a_row = _no_streak()
      return
    streak = self.rejected_in_a_row
    streak["count"] += len(rejected)
    streak["kinds"] = sorted(set(streak["kinds"]).union(rejected))
    streak["workers"] = sorted(set(streak["workers"]).union(
        range(len(rejected)) if workers is None else workers))
    if streak["count"] >= self.limit:
      raise DivergenceError(self._message(f"the last {streak['count']} pseudo-gradients"))

  def check_end(self, applied_updates: int) -> None:
    """Raises ``DivergenceError`` when a run ends with rejections and no update applied."""
    count = self.rejected_in_a_row["count"]
    if applied_updates == 0 and count > 0:
      raise DivergenceError(self._message(f"all {count} pseudo-gradients of the run"))

  def _message(self, which: str) -> str:
    kinds, workers = self.rejected_in_a_row["kinds"], self.rejected_in_a_row["workers"]
    named = ", ".join(str(w) for w in workers) or "?"
    if not set(kinds) <= {"nan", "inf"}:  # an aggregation screen's (ALGORITHMS.md)
      return (f"{which} (from worker{'s' if len(workers) != 1 else ''} {named}) were rejected "
              f"({', '.join(kinds)}): the training diverges or the screen is too strict; "
              "likely fixes: a looser hj.aggregate.screen (norm, cosine, warmup), or a lower "
              "inner learning rate")
    return (f"{which} (from worker{'s' if len(workers) != 1 else ''} {named}) were "
            f"non-finite ({', '.join(kinds) or 'nan or inf'}) and were rejected: "
            "the training diverges; likely fixes: a lower inner learning rate (or outer "
            "learning rate, when outer updates came first), gradient clipping, or data the "
            "model can take (e.g. no token id outside the vocabulary)")
