"""heloco_jax: asynchronous low-communication training in JAX.

The outer rules of docs/ALGORITHMS.md as optax transforms::

  import heloco_jax as hj
  tx = hj.heloco(learning_rate=0.7, momentum=0.9, num_workers=5)
  state = tx.init(params)
  updates, state = tx.update(pseudo_grads, state, params, staleness=tau)

and an engine that runs any model, loss, data and optimizers on K
heterogeneous workers (``hj.simulate``), or a server for a loop of your own
(``hj.Server``).
"""

from heloco_jax.api import Budget, SimulationResult, Workdir, make_engine, simulate
from heloco_jax.comm import compress, fragments
from heloco_jax.training import aggregate
from heloco_jax.comm.cost import CommModel
from heloco_jax.comm.compress import Compression
from heloco_jax.comm.fragments import Streaming
from heloco_jax.comm.syncer import Syncer
from heloco_jax.outer import (
    BRANCH_NAMES,
    CorrectionInfo,
    DelayedNesterovState,
    HeLoCoState,
    MLAState,
    arrival_weight,
    async_nesterov,
    block_names,
    cgad,
    delayed_nesterov,
    heloco,
    heloco_correct,
    heloco_diagnostics,
    lookahead_params,
    mla,
    outer_momentum,
    scale_by_age_gate,
    scale_by_arrival_weight,
)
from heloco_jax.rundir.workdir import WorkdirError
from heloco_jax.rundir.writers import TensorBoardWriter, Writers
from heloco_jax.runtime.engine import BudgetError, Stopped, stop_on_signals
from heloco_jax.runtime.factories import devices_runtime, ray_runtime, simulated_runtime
from heloco_jax.training.determinism import DeterminismError
from heloco_jax.training.determinism import enable as enable_deterministic_ops
from heloco_jax.training.inner import PalsgdState, palsgd_inner, scale_by_step_schedule
from heloco_jax.training.inner import adamw as inner_adamw
from heloco_jax.training.membership import Membership
from heloco_jax.training.methods import METHODS
from heloco_jax.training.rejection import DivergenceError
from heloco_jax.training.server import Server
from heloco_jax.training.sharding import fsdp_specs

__version__ = "0.1.0"

__all__ = [
    "METHODS", "Budget", "BudgetError", "Streaming", "Compression", "aggregate", "compress", "fragments", "CommModel", "DeterminismError",
    "DivergenceError", "Stopped",
    "Membership", "PalsgdState", "Server", "SimulationResult", "Syncer", "TensorBoardWriter", "WorkdirError",
    "Workdir", "Writers", "devices_runtime", "simulated_runtime", "stop_on_signals",
    "enable_deterministic_ops", "inner_adamw", "make_engine", "palsgd_inner",
    "ray_runtime", "scale_by_step_schedule", "simulate", "fsdp_specs",
    "BRANCH_NAMES", "CorrectionInfo", "DelayedNesterovState", "HeLoCoState", "MLAState",
    "arrival_weight", "async_nesterov", "block_names", "cgad", "heloco_correct", "delayed_nesterov", "heloco",
    "heloco_diagnostics", "lookahead_params", "mla", "outer_momentum", "scale_by_age_gate", "scale_by_arrival_weight",
]
