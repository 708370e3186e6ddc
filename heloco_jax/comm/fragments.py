"""θ split into fragments that sync on staggered schedules (ALGORITHMS.md, "Fragments").

A ``Fragments`` assigns every leaf of θ to one of P fragments. A fragment's
sub-tree has θ's structure with the other fragments' leaves replaced by None,
so any optax transform (the outer rules included) runs on it as on θ, and
its state holds the fragment's leaves only. With P = 1 the one fragment is θ
itself.

Layouts (``split``):

  contiguous   the leaves in θ's order, cut into P runs of about equal size
               (entries), as Streaming DiLoCo's consecutive layers
  strided      leaf i to fragment i mod P
  balanced     the largest leaf first, each to the fragment with the fewest
               entries so far (numel-balanced, as the HeLoCo authors' server)
  a function   ``(path, leaf) -> p``, the path as "layer0/attn/kernel"

Schedule: the j-th sync of a worker (j = 1, 2, ..., every H/P inner steps)
sends fragment j mod P, so fragment p syncs every H steps at offset p·H/P.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

LAYOUTS = ("contiguous", "strided", "balanced")
Layout = Union[str, Callable[[str, Any], int]]


@dataclasses.dataclass(frozen=True)
class Streaming:
  """θ synced a fragment at a time (``make_engine(streaming=...)``; ALGORITHMS.md, "Fragments").

  Streaming DiLoCo for diloco and local_sgd, per-fragment rules for the asynchronous
  methods. ``hj.Streaming()`` (P = 1) syncs θ whole, as no ``streaming`` does.

  Attributes:
    fragments: P: θ's leaves split into P fragments, fragment p synced every H steps at
      offset p·H/P, each with its own outer state and staleness. P must divide H; not with
      ddp or palsgd; on every runtime (simulated, devices, Ray).
    layout: "contiguous", "strided", "balanced", or a function ``(path, leaf) -> fragment``
      (``split``).
    overlap_steps: τ: inner steps a worker takes while its fragment's sync is in flight,
      in [0, H/P).
    alpha: α in (0, 1]: the worker keeps α·(θ_p as it arrives) + (1 − α)·(its own θ_p);
      1: the arrived θ_p.

  Example::

    hj.simulate(loss_fn, params, data, method="diloco", budget=hj.Budget(steps=400),
                streaming=hj.Streaming(fragments=2, overlap_steps=1))
  """
  fragments: int = 1
  layout: Layout = "contiguous"
  overlap_steps: int = 0
  alpha: float = 1.0


# ``refusal``'s names -> those of ``make_engine``'s arguments.
PUBLIC_NAMES = {"fragments": "streaming.fragments", "overlap_steps": "streaming.overlap_steps",
                "fragment_alpha": "streaming.alpha", "grace_window": "syncer.grace_window",
                "quorum": "syncer.quorum", "adaptive_grace": "syncer.adaptive_grace",
                "dylu": "method_options['dylu']"}


@dataclasses.dataclass(frozen=True)
class Fragments:
  """Which fragment each leaf of θ belongs to.

  Attributes:
    assignment: per leaf of θ (in ``jax.tree.leaves`` order), its fragment.
    num: P, the number of fragments.
  """
  assignment: tuple[int, ...]
  num: int

  def take(self, tree: Any, p: int) -> Any:
    """Fragment ``p`` of a θ-shaped ``tree``: the other leaves replaced by None (with P = 1,
    ``tree`` itself)."""
    if self.num == 1:
      return tree
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [x if a == p else None
                                        for x, a in zip(leaves, self.assignment)])

  def put(self, tree: Any, part: Any, p: int) -> Any:
    """``tree`` with fragment ``p``'s leaves replaced by ``part``'s (a ``take`` of it)."""
    if self.num == 1:
      return part
    leaves, treedef = jax.tree.flatten(tree)
    new = iter(jax.tree.leaves(part))
    return jax.tree.unflatten(treedef, [next(new) if a == p else x
                                        for x, a in zip(leaves, self.assignment)])

  def merge(self, parts: Sequence[Any]) -> Any:
    """θ from its P fragments' sub-trees."""
    if self.num == 1:
      return parts[0]
    iterators = [iter(jax.tree.leaves(part)) for part in parts]
    treedef = jax.tree.structure(parts[0], is_leaf=lambda x: x is None)
    return jax.tree.unflatten(treedef, [next(iterators[a]) for a in self.assignment])

  def sizes(self, params: Any) -> list[int]:
    """Entries per fragment."""
    sizes = [0] * self.num
    for leaf, a in zip(jax.tree.leaves(params), self.assignment):
      sizes[a] += int(np.size(leaf))
    return sizes

  def of_sync(self, j: int) -> int:
    """The fragment the j-th sync (j >= 1) sends: j mod P."""
    return j % self.num


def split(params: Any, num: int, layout: Layout = "contiguous") -> Fragments:
  """θ's leaves in ``num`` fragments by ``layout`` (the module docstring).

  Args:
    params: θ (any pytree of arrays).
    num: P, an integer in [1, number of leaves].
    layout: "contiguous", "strided", "balanced", or ``(path, leaf) -> p``.

  Returns:
    The ``Fragments``.

  Raises:
    ValueError: ``num`` is not an integer in [1, number of leaves], ``layout``
      is not allowed, or a fragment would be empty (the message says which).

  Examples:
    >>> import jax.numpy as jnp
    >>> from heloco_jax import fragments
    >>> params = {"embed": jnp.zeros((100, 8)), "head": jnp.zeros((8, 100)),
    ...           "norm": jnp.zeros(8)}
    >>> split = fragments.split(params, 2, "balanced")
    >>> split.assignment, split.sizes(params)    # leaves: embed, head, norm
    ((0, 1, 0), [808, 800])
    >>> split.take(params, 0)["head"] is None
    True
    >>> fragments.split(params, 2, lambda path, leaf: 0)
    Traceback (most recent call last):
    ...
    ValueError: fragment_layout='<lambda>' leaves fragment 1 of 2 empty; allowed: a layout that gives every fragment a leaf
  """
  leaves_with_paths = jax.tree_util.tree_leaves_with_path(params)
  n = len(leaves_with_paths)
  if isinstance(num, bool) or not isinstance(num, (int, np.integer)) or not 1 <= num <= n:
    raise ValueError(f"fragments={num!r} is not allowed; allowed: an integer in [1, {n}] "
                     f"(θ has {n} leaves)")
  sizes = [int(np.size(leaf)) for _, leaf in leaves_with_paths]
  if callable(layout):
    assignment = []
    for path, leaf in leaves_with_paths:
      name = jax.tree_util.keystr(path, simple=True, separator="/")
      p = layout(name, leaf)
      if isinstance(p, bool) or not isinstance(p, (int, np.integer)) or not 0 <= p < num:
        raise ValueError(f"fragment_layout gave {p!r} for leaf {name!r}; allowed: an integer "
                         f"in [0, {num})")
      assignment.append(int(p))
  elif layout == "contiguous":
    total, assignment, done = sum(sizes), [], 0
    for i, size in enumerate(sizes):  # a cut where the running total passes p/P of all
      p = min(num - 1, math.floor(done * num / total)) if total else i * num // n
      p = max(p, num - (n - i))  # leave a leaf for every later fragment
      if assignment:
        p = min(max(p, assignment[-1]), assignment[-1] + 1)
      assignment.append(p)
      done += size
  elif layout == "strided":
    assignment = [i % num for i in range(n)]
  elif layout == "balanced":
    assignment, load = [0] * n, [0] * num
    for i in sorted(range(n), key=lambda i: (-sizes[i], i)):
      p = min(range(num), key=lambda q: (load[q], q))
      assignment[i] = p
      load[p] += sizes[i]
  else:
    raise ValueError(f"fragment_layout={layout!r} is not allowed; allowed: one of "
                     f"{', '.join(map(repr, LAYOUTS))} or a function (path, leaf) -> fragment")
  empty = sorted(set(range(num)) - set(assignment))
  if empty:
    raise ValueError(f"fragment_layout={getattr(layout, '__name__', layout)!r} leaves fragment "
                     f"{empty[0]} of {num} empty; allowed: a layout that gives every fragment "
                     "a leaf")
  return Fragments(tuple(assignment), num)


def refusal(*, method: Any, fragments: Any, overlap_steps: Any, alpha: Any,
            inner_steps: int, reset_optimizer: Any,
            grace_window: float, dylu: bool, quorum: int = 1, adaptive_grace: float = 0.0
            ) -> Optional[tuple[str, Any, str]]:
  """The first fragment setting a run cannot take, as (name, value, what is allowed), or None.

  ``hj.make_engine`` and the CLI's config validation word it each in their own names.
  """
  if fragments == 1:
    for name, value, default in (("overlap_steps", overlap_steps, 0),
                                 ("fragment_alpha", alpha, 1.0)):
      if value != default:
        return name, value, f"{default!r} with fragments=1 (or fragments > 1: streaming)"
    return None
  why = {"step": "ddp averages gradients every step"}.get(method.synchrony) or (
      "PALSGD's pull needs θ whole" if method.inner == "palsgd" else "")
  if why:
    return "fragments", fragments, f"1 with method={method.name!r} ({why})"
  if inner_steps % fragments:
    return "fragments", fragments, (f"a divisor of inner_steps={inner_steps} (a fragment syncs "
                                    "every H/P steps)")
  per_sync = inner_steps // fragments
  if isinstance(overlap_steps, bool) or not isinstance(overlap_steps, (int, np.integer)) or \
      not 0 <= overlap_steps < per_sync:
    return "overlap_steps", overlap_steps, (f"an integer in [0, {per_sync}) (below H/P = "
                                            f"{inner_steps}/{fragments})")
  if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0 < alpha <= 1:
    return "fragment_alpha", alpha, "a number in (0, 1]"
  for name, value, default in (("reset_optimizer", reset_optimizer, None),
                               ("grace_window", grace_window, 0.0), ("quorum", quorum, 1),
                               ("adaptive_grace", adaptive_grace, 0.0), ("dylu", dylu, False)):
    if value not in (default, False):
      return name, value, (f"{default!r} with fragments={fragments} (workers sync one fragment "
                           "at a time and never restart as a whole)")
  return None


@jax.jit
def blend(alpha: jax.Array, arrived: Any, local: Any) -> Any:
  """α·arrived + (1 − α)·local, leaf by leaf (Streaming DiLoCo's merge of a synced
  fragment)."""
  return jax.tree.map(lambda g, x: (alpha * g + (1 - alpha) * x).astype(x.dtype), arrived, local)


def merge_arrived(alpha: float, arrived: Any, local: Any) -> Any:
  """The worker's value of a fragment that arrived: ``arrived`` itself for α = 1 (bit for
  bit), else ``blend``."""
  if alpha == 1.0:
    return arrived
  return blend(jnp.float32(alpha), arrived, local)
