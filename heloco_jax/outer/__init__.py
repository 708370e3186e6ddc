"""Outer rules as optax transforms (ALGORITHMS.md): one module per rule."""

from heloco_jax.outer.cgad import cgad
from heloco_jax.outer.correction import BRANCH_NAMES, CorrectionInfo, block_names, heloco_correct
from heloco_jax.outer.delayed_nesterov import DelayedNesterovState, delayed_nesterov
from heloco_jax.outer.heloco import HeLoCoState, heloco
from heloco_jax.outer.lookahead import heloco_diagnostics, lookahead_params, outer_momentum
from heloco_jax.outer.mla import MLAState, mla
from heloco_jax.outer.nesterov import async_nesterov
from heloco_jax.outer.weighting import arrival_weight, scale_by_age_gate, scale_by_arrival_weight

__all__ = [
    "BRANCH_NAMES", "CorrectionInfo", "DelayedNesterovState", "HeLoCoState", "MLAState",
    "arrival_weight", "async_nesterov", "block_names", "cgad", "delayed_nesterov", "heloco",
    "heloco_correct", "heloco_diagnostics", "lookahead_params", "outer_momentum", "mla",
    "scale_by_age_gate", "scale_by_arrival_weight",
]
