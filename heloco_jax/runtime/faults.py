"""Faulty workers: named workers whose pseudo-gradients are altered before they are sent
(docs/ALGORITHMS.md, "Faulty workers"; the CLI's ``chaos.faulty``).

A ``Faults`` names workers and what each does to its Δ = start − end before upload (before
compression, before the server's rejection of non-finite Δ and its ``hj.aggregate`` rule):

  sign        Δ → −Δ
  scale=s     Δ → s·Δ (s finite, ≠ 1)
  noise=σ     Δ → Δ + σ·rms(Δ_leaf)·ξ per leaf, ξ ~ N(0, 1) from the dispatch's own key
              (deterministic per seed, and across a resume)
  nan         Δ → NaN everywhere (the server rejects it)
  replay=n    Δ_k → Δ_{max(0, k − n)}: the worker's own honest Δ of n dispatches (rounds)
              earlier, its first until it has n (a stale replay; ``state.ReplayState`` holds the
              last n, and a checkpoint keeps them)

``faulty(runtime, faults)`` wraps a runtime factory: its executor's results are altered from
the outside (an asynchronous dispatch's Δ, a fragment's Δ, a synchronous round's ends as
θ − f(θ − end_i)), so no loop knows of it. Spelled ``"1:sign,3:scale=10,4:noise=0.1"``
(``Faults.parse``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Literal, Optional, get_args

import jax
import jax.numpy as jnp

from heloco_jax.runtime import factories
from heloco_jax.runtime import state as state_lib

Behaviour = Literal["sign", "scale", "noise", "nan", "replay"]
VALUED = ("scale", "noise", "replay")  # the behaviours spelled with '=VALUE'
BEHAVIOURS: tuple[str, ...] = get_args(Behaviour)
_SPEC = re.compile(r"^\s*(\d+)\s*:\s*([a-z]+)\s*(?:=\s*([^,\s]+))?\s*$")
# Folded into a dispatch's key for its noise (the inner loop splits the key itself).
_NOISE_STREAM = 0x5EED


@dataclasses.dataclass(frozen=True)
class Fault:
  """Worker ``worker`` alters its Δ: ``behaviour`` with ``value`` (scale's s, noise's σ)."""
  worker: int
  behaviour: Behaviour
  value: float = 0.0

  def __str__(self) -> str:
    return f"{self.worker}:{self.behaviour}" + (
        f"={self.value:g}" if self.behaviour in VALUED else "")


@dataclasses.dataclass(frozen=True)
class Faults:
  """The faulty workers of a run (module docstring); empty: none."""
  faults: tuple[Fault, ...] = ()

  @classmethod
  def parse(cls, text: str, name: str = "chaos.faulty") -> "Faults":
    """``"1:sign,3:scale=10,4:noise=0.1,5:nan,6:replay=2"``; '' is none.

    Raises:
      ValueError: one line naming ``name`` and the entry that is not allowed.
    """
    faults = []
    for entry in [e for e in str(text).split(",") if e.strip()]:
      match = _SPEC.match(entry)
      allowed = ("'W:sign', 'W:scale=S', 'W:noise=SIGMA', 'W:nan' or 'W:replay=N', "
                 "comma-separated (e.g. '1:sign,3:scale=10,4:noise=0.1')")
      if not match or match.group(2) not in BEHAVIOURS:
        raise ValueError(f"{name}={text!r} is not allowed ({entry.strip()!r}); allowed: "
                         f"{allowed}")
      worker, behaviour, value = int(match.group(1)), match.group(2), match.group(3)
      needs = behaviour in VALUED
      if needs != (value is not None):
        raise ValueError(f"{name}={text!r} is not allowed ({entry.strip()!r}: {behaviour} "
                         f"takes {'a value' if needs else 'no value'}); allowed: {allowed}")
      try:
        number = float(value) if needs else 0.0
      except ValueError:
        number = math.nan
      valid = {"scale": lambda x: x != 1.0, "noise": lambda x: x > 0,
               "replay": lambda x: x >= 1 and x == int(x)}
      if needs and not (math.isfinite(number) and valid[behaviour](number)):
        raise ValueError(f"{name}={text!r} is not allowed ({entry.strip()!r}); allowed: " + {
            "scale": "scale=S with S finite and not 1",
            "noise": "noise=SIGMA with SIGMA finite and > 0",
            "replay": "replay=N with N a whole number >= 1"}[behaviour])
      faults.append(Fault(worker, behaviour, number))
    workers = [f.worker for f in faults]
    if len(set(workers)) < len(workers):
      twice = next(w for w in workers if workers.count(w) > 1)
      raise ValueError(f"{name}={text!r} is not allowed (worker {twice} named twice); "
                       "allowed: one behaviour per worker")
    return cls(tuple(faults))

  def refusal(self, num_workers: int) -> Optional[str]:
    """Why these faults do not fit a run of ``num_workers`` workers, or None."""
    for fault in self.faults:
      if fault.worker >= num_workers:
        return f"worker {fault.worker} does not exist (workers 0 … {num_workers - 1})"
    if self.faults and len(self.faults) >= num_workers:
      return f"every one of the {num_workers} workers is faulty (at least one must be honest)"
    return None

  def of(self, worker: int) -> Optional[Fault]:
    return next((f for f in self.faults if f.worker == worker), None)

  def __str__(self) -> str:
    return ",".join(str(f) for f in self.faults)


def alter(fault: Fault, delta: Any, key: jax.Array) -> Any:
  """``delta`` as ``fault`` sends it (module docstring); ``key`` only for noise. A replay
  depends on the worker's earlier Δ: ``state.ReplayState.send``."""
  if fault.behaviour == "replay":
    raise ValueError("a replay sends an earlier Δ: ReplayState.send, not alter")
  leaves, treedef = jax.tree.flatten(delta)
  if fault.behaviour == "sign":
    out = [-x for x in leaves]
  elif fault.behaviour == "scale":
    out = [(fault.value * x).astype(x.dtype) for x in leaves]
  elif fault.behaviour == "nan":
    out = [jnp.full_like(x, jnp.nan) for x in leaves]
  else:
    keys = jax.random.split(jax.random.fold_in(key, _NOISE_STREAM), max(len(leaves), 1))
    out = []
    for x, k in zip(leaves, keys):
      x32 = x.astype(jnp.float32)
      rms = jnp.sqrt(jnp.mean(jnp.square(x32))) if x.size else jnp.float32(0.0)
      out.append((x32 + fault.value * rms * jax.random.normal(k, x.shape)).astype(x.dtype))
  return treedef.unflatten(out)


_alter = jax.jit(alter, static_argnums=0)


def _round_delta(start: Any, ends: Any, worker: int) -> Any:
  """Worker ``worker``'s Δ of a round: ``start`` − its end (``ends`` stacked on axis 0)."""
  return jax.tree.map(lambda s, e: s - e[worker], start, ends)


class FaultyExecutor:
  """``executor`` whose faulty workers' Δ are altered (``Faults``) before they are sent."""

  def __init__(self, executor: Any, faults: Faults):
    self._executor = executor
    self.faults = faults
    self.replay = state_lib.ReplayState()  # the run's ``Features.replay`` (``Runtime.features``)
    self._rounds = jax.jit(self._round_ends)
    self._take = jax.jit(lambda tree, w: jax.tree.map(lambda x: x[w], tree), static_argnums=1)
    self._honest = jax.jit(_round_delta, static_argnums=2)

  def __getattr__(self, name: str) -> Any:
    return getattr(self._executor, name)

  def _altered(self, worker: int, delta: Any, key: jax.Array) -> Any:
    fault = self.faults.of(worker)
    if fault is None:
      return delta
    delta = self._executor.fetch(delta, "delta")
    if fault.behaviour == "replay":
      return self.replay.send(worker, int(fault.value), delta)
    return _alter(fault, delta, key)

  def run_worker(self, worker, previous, start, batches, key, carry=False):
    state, delta, loss = self._executor.run_worker(worker, previous, start, batches, key, carry)
    return state, self._altered(worker, delta, key), loss

  def run_fragment(self, worker, previous, steps, batches, key):
    state, delta, loss = self._executor.run_fragment(worker, previous, steps, batches, key)
    return state, self._altered(worker, delta, key), loss

  def _round_ends(self, starts: dict[int, Any], ends: Any, keys: jax.Array,
                  replayed: dict[int, Any]) -> Any:
    """Round ends (stacked on axis 0) with each faulty worker's as start − f(start − end)
    (a replaying worker's f(Δ): ``replayed``)."""
    for fault in self.faults.faults:
      w, start = fault.worker, starts[fault.worker]
      delta = replayed[w] if w in replayed else alter(fault, _round_delta(start, ends, w),
                                                      keys[w])
      ends = jax.tree.map(lambda e, s, d: e.at[w].set((s - d).astype(e.dtype)), ends, start,
                          delta)
    return ends

  def run_round(self, states, batches, keys, anchor):
    # The faulty workers' starts (θ), copied: the inner loop donates the states it is given.
    starts = {f.worker: self._take(states.params, f.worker) for f in self.faults.faults}
    ends, metrics = self._executor.run_round(states, batches, keys, anchor)
    replayed = {f.worker: self.replay.send(f.worker, int(f.value),
                                           self._honest(starts[f.worker], ends.params, f.worker))
                for f in self.faults.faults if f.behaviour == "replay"}
    return ends._replace(params=self._rounds(starts, ends.params, keys, replayed)), metrics


def faulty(runtime: Optional[factories.RuntimeFactory], faults: Faults
           ) -> factories.RuntimeFactory:
  """``runtime`` (default: simulated) whose ``faults``' workers alter their Δ before sending.

  Raises (when the run is built):
    ValueError: faults that do not fit the run (``Faults.refusal``), DDP (no pseudo-gradient)
      or Streaming DiLoCo's rounds (a worker's own θ carries over), in one line naming
      ``chaos.faulty``.
  """
  inner_factory = runtime or factories.simulated_runtime()
  if not faults.faults:
    return inner_factory

  def build(inner, spec):
    why = faults.refusal(spec.num_workers)
    if why is None and spec.method.synchrony == "step":
      why = "DDP sends gradients every step, not pseudo-gradients"
    if why is None and spec.method.synchrony == "round" and spec.fragments > 1:
      why = "Streaming DiLoCo's workers keep their own θ across rounds"
    if why is None and spec.fragments > 1 and any(f.behaviour == "replay"
                                                  for f in faults.faults):
      why = "a replay resends a whole θ's Δ and fragments send one fragment's"
    if why:
      raise ValueError(f"chaos.faulty={str(faults)!r} is not allowed: {why}; allowed: "
                       "faulty workers of a run with pseudo-gradients")
    built = inner_factory(inner, spec)
    executor = FaultyExecutor(built.executor, faults)
    return dataclasses.replace(built, executor=executor,
                               features={**built.features, "replay": executor.replay})
  return dataclasses.replace(inner_factory, build=build)
