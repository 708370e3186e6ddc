"""Test-session settings: one persistent XLA compilation cache for the whole run
(and its subprocesses).

Many tests build fresh jitted functions for identical programs (a new
``Simulation`` or ``InnerLoop`` per test); the cache lets XLA compile each
distinct program once per session instead of once per test.
"""

import os
import tempfile

import jax

_CACHE = tempfile.TemporaryDirectory(prefix="heloco_jax_xla_cache_")
# Subprocesses (the kill-and-resume tests) share the cache through the environment.
os.environ.update({"JAX_COMPILATION_CACHE_DIR": _CACHE.name,
                   "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                   "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"})
jax.config.update("jax_compilation_cache_dir", _CACHE.name)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
