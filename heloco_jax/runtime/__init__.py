"""Runtimes: where a run's work happens, and the engine that drives them.

A ``Runtime`` (``base``) composes an executor (``simulated.LocalExecutor``,
``devices.DeviceExecutor``, ``ray.RayExecutor``), a clock (``SimulatedClock``,
``RealClock``) and an arrival queue; ``factories`` builds the usual ones
(``hj.simulated_runtime``, ``hj.devices_runtime``, ``hj.ray_runtime``).
``engine.Engine`` runs any method of the registry on any of them. The Ray
module is imported only when used.
"""

from heloco_jax.runtime.base import Clock, Executor, RoundExecutor, Runtime
from heloco_jax.runtime.clocks import RealClock
from heloco_jax.runtime.engine import Engine
from heloco_jax.runtime.factories import (
                                          RuntimeFactory,
                                          devices_runtime,
                                          ray_runtime,
                                          simulated_runtime,
)
from heloco_jax.runtime.simulated import LocalExecutor, SimulatedClock
from heloco_jax.runtime.state import Budget, Run, RunSpec, RunState
from heloco_jax.training.rejection import DivergenceError

__all__ = ["Budget", "Clock", "DivergenceError", "Engine", "Executor", "LocalExecutor",
           "RealClock", "RoundExecutor", "Run", "RunSpec", "RunState", "Runtime",
           "RuntimeFactory", "SimulatedClock", "devices_runtime", "ray_runtime",
           "simulated_runtime"]
