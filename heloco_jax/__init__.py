"""heloco_jax: asynchronous low-communication training of language models in JAX.

The outer rules of ALGORITHMS.md as optax transforms::

  import heloco_jax as hj
  tx = hj.heloco(learning_rate=0.7, momentum=0.9, num_workers=5)
  state = tx.init(params)
  updates, state = tx.update(pseudo_grads, state, params, staleness=tau)
"""

from heloco_jax.outer import (
    BRANCH_NAMES,
    CorrectionInfo,
    DelayedNesterovState,
    HeLoCoState,
    MLAState,
    arrival_weight,
    async_nesterov,
    block_names,
    correct,
    delayed_nesterov,
    heloco,
    heloco_diagnostics,
    lookahead_params,
    mla,
    outer_momentum,
    scale_by_arrival_weight,
)

__version__ = "0.1.0"

__all__ = [
    "BRANCH_NAMES", "CorrectionInfo", "DelayedNesterovState", "HeLoCoState", "MLAState",
    "arrival_weight", "async_nesterov", "block_names", "correct", "delayed_nesterov", "heloco",
    "heloco_diagnostics", "lookahead_params", "mla", "outer_momentum", "scale_by_arrival_weight",
]
