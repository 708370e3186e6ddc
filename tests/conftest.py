"""Test-session settings: one persistent XLA compilation cache for the whole run.

Many tests build fresh jitted functions for identical programs (a new
``Simulation`` or ``InnerLoop`` per test); the cache lets XLA compile each
distinct program once per session instead of once per test.
"""

import tempfile

import jax

_CACHE = tempfile.TemporaryDirectory(prefix="heloco_jax_xla_cache_")
jax.config.update("jax_compilation_cache_dir", _CACHE.name)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
