"""Streaming DiLoCo's fragments in a run (docs/ALGORITHMS.md, "Fragments"): the state a
streaming run keeps per fragment and per worker, and the asynchronous loop's hooks, the
dispatch of a fragment's H/P steps and what a worker received.

The round loop's streaming (``loops.run_rounds``) shares ``split_steps``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from heloco_jax.comm import fragments as fragments_lib
from heloco_jax.runtime.base import Job



class Run(Protocol):
  """What this module reads of a run: ``runtime.state.Run``, named by its attributes and not
  imported (state.py imports this module; no import circle, docs/DESIGN.md's layout)."""
  spec: Any
  state: Any
  server: Any
  features: Any
  fragments: Any
  executor: Any
  clock: Any
  downlink: Any
  model_states: Any
  batches: Any

  def next_key(self) -> Any: ...


@dataclasses.dataclass
class StreamingState:
  """A streaming run's fragments (a checkpoint's "streaming" entry): each fragment's version;
  per worker, its syncs so far (the round loop: one count) and the version of each fragment
  when it last received it; the anchors (per worker, θ as it last received each fragment:
  the start of the fragment's Δ; saved as the "anchors" arrays); the round loop's workers
  that missed a round (away: they start the next one they take part in from θ as a whole)."""
  fragment_versions: list = dataclasses.field(default_factory=list)
  syncs: list = dataclasses.field(default_factory=list)
  received: list = dataclasses.field(default_factory=list)
  anchors: Any = dataclasses.field(default=None, metadata={"array": "anchors"})
  missed: list = dataclasses.field(default_factory=list)

  def start(self, fragments: int, num_workers: int) -> None:
    """The asynchronous loop's first state: every worker receives θ as a whole first."""
    self.fragment_versions = [0] * fragments
    self.syncs, self.received = [0] * num_workers, [None] * num_workers
    self.anchors = [None] * num_workers

  def restart(self, worker: int) -> None:
    """``worker`` comes back to θ as a whole (a rejection, a departure; FAILURES.md)."""
    self.syncs[worker] = 0


def received(run: Run, worker: int) -> Optional[int]:
  """What the worker whose work arrives received when it was dispatched: None for θ as a
  whole, or with fragments the fragment it had sent before."""
  syncs = run.features.streaming.syncs[worker] if run.spec.streaming else 0
  return None if syncs <= 1 else (syncs - 1) % run.spec.fragments


def dispatch_fragment(run: Run, worker: int, now: float) -> Job:
  """A worker's next H/P steps, which end in its next fragment's Δ (ALGORITHMS.md,
  "Fragments"). It first receives the fragment it sent last (its server's dispatch point;
  all of θ at a first dispatch), which replaces (α = 1) or blends into its own after τ
  steps; the Δ of fragment p is its anchor (p as last received) − the end's p."""
  f, spec, fragments, link = run.features.streaming, run.spec, run.fragments, run.downlink
  steps = spec.inner_steps // spec.fragments
  last = f.syncs[worker]
  if last == 0:  # θ as a whole: a first dispatch, or after a rejection
    start = run.server.dispatch_point() if link is None else link.whole(worker, run.server)
    f.anchors[worker], f.received[worker] = start, list(f.fragment_versions)
    received, arrived = None, None
  else:
    received = last % spec.fragments
    if link is None:
      arrived = run.server.fragment_point(received)
      f.anchors[worker] = fragments.put(f.anchors[worker], arrived, received)
    else:  # ALGORITHMS.md, "Compressed downloads": x̂ is the anchor
      f.anchors[worker], arrived = link.fragment(worker, run.server, f.anchors[worker],
                                                 received)
    f.received[worker][received] = f.fragment_versions[received]
    start = None
  f.syncs[worker] = last + 1
  sent = f.syncs[worker] % spec.fragments
  anchor = (fragments.take(f.anchors[worker], sent) if link is None else
            link.anchor(f.anchors[worker], sent))
  plan = FragmentSteps(fragments, spec.fragment_alpha, spec.overlap_steps, start, arrived,
                       received, anchor, sent)
  # The server's model state comes with every fragment (DESIGN.md, "Model state and randomness").
  previous = run.model_states.for_dispatch(worker, run.state.workers[worker])
  work = functools.partial(run.executor.run_fragment, worker, previous, plan,
                           run.batches(worker, steps), run.next_key())
  finish = run.clock.fragment_arrival(worker, steps, now, received, sent)
  return Job(None, f.received[worker][sent], steps * spec.units_per_step, finish, work,
             fragment=sent)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["start", "arrived", "anchor"],
                   meta_fields=["fragments", "alpha", "tau", "received", "sent"])
@dataclasses.dataclass(frozen=True)
class FragmentSteps:
  """What a worker's fragment dispatch computes (``dispatch_fragment``): its steps from
  ``start`` (θ as a whole) or from its own params with fragment ``received`` merged in
  (``arrived``: that fragment's θ) after ``tau`` steps, and the Δ of fragment ``sent``
  against ``anchor`` (that fragment as the worker last received it). Values only, a pytree
  of its arrays: an executor may run it in another process (Ray's worker actors)."""
  fragments: fragments_lib.Fragments
  alpha: float
  tau: int
  start: Any
  arrived: Any
  received: Optional[int]
  anchor: Any
  sent: int

  def run(self, run_worker: Callable[..., tuple[Any, Any, Any]], worker: int, previous: Any,
          batches: Any, key: jax.Array) -> tuple[Any, Any, Any]:
    """(end state, Δ of fragment ``sent``, mean training loss), the inner steps by
    ``run_worker`` (an executor's)."""
    fragments, received, tau = self.fragments, self.received, self.tau
    steps = jax.tree.leaves(batches)[0].shape[0]

    def merged(params):  # the arrived fragment in the worker's params
      assert received is not None  # not a first dispatch
      local = fragments.take(params, received)
      arrived_here = _beside(self.arrived, local)
      return fragments.put(params, fragments_lib.merge_arrived(self.alpha, arrived_here, local),
                           received)

    if self.start is not None:
      state, _, loss = run_worker(worker, previous, self.start, batches, key)
    elif tau == 0:
      state, _, loss = run_worker(worker, previous, merged(previous.params), batches, key)
    else:  # τ steps while the fragment is in flight, then the rest
      head, tail = split_steps(batches, tau, axis=0)
      first, second = jax.random.split(key)
      state, _, head_loss = run_worker(worker, previous, previous.params, head, first)
      state, _, tail_loss = run_worker(worker, state, merged(state.params), tail, second)
      loss = jax.tree.map(lambda a, b: (tau * a + (steps - tau) * b) / steps, head_loss,
                          tail_loss)
    end = fragments.take(state.params, self.sent)
    return state, _subtract(_beside(self.anchor, end), end), loss  # where the worker is


def split_steps(batches: Any, tau: int, axis: int) -> tuple[Any, Any]:
  """``batches`` cut after ``tau`` steps along ``axis``."""
  head = jax.tree.map(lambda x: np.take(x, np.arange(tau), axis=axis), batches)
  tail = jax.tree.map(lambda x: np.take(x, np.arange(tau, x.shape[axis]), axis=axis), batches)
  return head, tail


def _beside(tree: Any, like: Any) -> Any:
  """``tree`` placed as ``like`` is, leaf by leaf (a worker may compute on other devices than
  the server's); as it is where ``like`` is on the host."""
  return jax.tree.map(lambda x, y: jax.device_put(x, y.sharding) if isinstance(y, jax.Array)
                      else x, tree, like)


@jax.jit
def _subtract(a: Any, b: Any) -> Any:
  return jax.tree.map(jnp.subtract, a, b)
