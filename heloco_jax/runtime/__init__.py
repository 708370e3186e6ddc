"""Runtimes: where a run's work happens, and the engine that drives them.

``Runtime`` (``base``) is the protocol; ``SimulatedRuntime`` (one device,
simulated clock), ``DeviceRuntime`` (groups of real devices) and
``RayRuntime`` (actors) implement it. ``engine.Engine`` runs any method of
the registry on any of them. The Ray module is imported only when used.
"""

from heloco_jax.runtime.base import Clock, RealClock, Runtime, SimulatedClock
from heloco_jax.runtime.engine import Engine
from heloco_jax.runtime.state import Budget, Fault, RunSpec, RunState
from heloco_jax.rejection import DivergenceError
from heloco_jax.runtime.simulated import SimulatedRuntime

__all__ = ["Budget", "Clock", "DivergenceError", "Engine", "Fault", "RealClock", "RunSpec",
           "RunState", "Runtime", "SimulatedClock", "SimulatedRuntime"]
