"""The method registry: every method is data, not a copy of the training loop.

A method is (synchrony, outer rule, dispatch rule, inner variant), run by the
one scheduler of ``heloco_jax.scheduler`` (DESIGN.md, "The idea in one
picture"):

  method            synchrony  outer rule (optax)                         dispatch   inner
  ddp               step       none: AdamW on gradients averaged over K    θ          plain
  local_sgd         round      optax.sgd(1): θ ← mean θ_i                  θ          plain
  diloco            round      optax.sgd(η, μ, nesterov=True)              θ          plain
  palsgd            round      optax.sgd(η, μ, nesterov=True) on θ̃         θ          palsgd
  async_nesterov    async      hj.async_nesterov                           θ          plain
  delayed_nesterov  async      hj.delayed_nesterov                         θ          plain
  mla               async      hj.mla                                      θ or look-ahead (option)
  heloco            async      hj.heloco                                   look-ahead plain

Default outer learning rates and momenta are those of ALGORITHMS.md.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax.numpy as jnp
import ml_collections
import optax

from heloco_jax import outer

SYNCHRONIES = ("step", "round", "async")


@dataclasses.dataclass(frozen=True)
class Method:
  """One entry of the registry.

  Attributes:
    name: the config's ``method``.
    synchrony: "step" (DDP: every inner step is synchronous), "round" (all
      workers start together, a barrier every H steps) or "async" (one outer
      update per arrival, no barrier).
    make_outer: builds the outer rule from the config (None for DDP).
    lookahead_dispatch: dispatch from θ − η·μ·m instead of θ by default.
    inner: "plain" or "palsgd" (pseudo-sync steps toward θ̃).
    reset_optimizer: the inner AdamW moments are reset at every dispatch by
      default (PALSGD keeps them local).
    learning_rate: the default outer η.
  """
  name: str
  synchrony: str
  make_outer: Optional[Callable[[ml_collections.ConfigDict], optax.GradientTransformation]]
  lookahead_dispatch: bool = False
  inner: str = "plain"
  reset_optimizer: bool = True
  learning_rate: float = 0.7


def outer_learning_rate(config: ml_collections.ConfigDict, method: Method) -> float:
  """``outer.learning_rate`` when set (> 0), else the method's default."""
  return config.outer.learning_rate if config.outer.learning_rate > 0 else method.learning_rate


def _nesterov(config):
  return optax.sgd(outer_learning_rate(config, METHODS[config.method]),
                   momentum=config.outer.momentum, nesterov=True, accumulator_dtype=jnp.float32)


def _async_kwargs(config):
  return dict(num_workers=config.num_workers, weighting=config.outer.weighting)


METHODS: dict[str, Method] = {m.name: m for m in [
    Method("ddp", "step", None),
    Method("local_sgd", "round", lambda c: optax.sgd(1.0), learning_rate=1.0),
    Method("diloco", "round", _nesterov),
    Method("palsgd", "round", _nesterov, inner="palsgd", reset_optimizer=False),
    Method("async_nesterov", "async",
           lambda c: outer.async_nesterov(outer_learning_rate(c, METHODS["async_nesterov"]),
                                          c.outer.momentum, **_async_kwargs(c)),
           learning_rate=0.07),
    Method("delayed_nesterov", "async",
           lambda c: outer.delayed_nesterov(
               outer_learning_rate(c, METHODS["delayed_nesterov"]), c.outer.momentum,
               buffer_size=c.outer.buffer_size or c.num_workers, c=c.outer.dn_c,
               **_async_kwargs(c)),
           learning_rate=0.07),
    Method("mla", "async",
           lambda c: outer.mla(outer_learning_rate(c, METHODS["mla"]), c.outer.momentum,
                               **_async_kwargs(c))),
    Method("heloco", "async",
           lambda c: outer.heloco(
               outer_learning_rate(c, METHODS["heloco"]), c.outer.momentum,
               keep_threshold=c.outer.keep_threshold, bad_threshold=c.outer.bad_threshold,
               shrink_strength=c.outer.shrink_strength, max_shrink=c.outer.max_shrink,
               rotate_strength=c.outer.rotate_strength,
               confidence_scale=c.outer.confidence_scale,
               rotate_schedule=c.outer.rotate_schedule, weight_order=c.outer.weight_order,
               scope=c.outer.scope, **_async_kwargs(c)),
           lookahead_dispatch=True),
]}
