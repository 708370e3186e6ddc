"""Test-session settings, for this process and the subprocesses tests start.

* One persistent XLA compilation cache for the whole run: many tests build
  fresh jitted functions for identical programs (a new engine or
  ``InnerLoop`` per test); the cache compiles each once per session.
* On a GPU (docs/DESIGN.md, "Determinism"): XLA's deterministic ops, so that
  replays are bit-exact; matmuls at full float32 precision (not TF32) and
  IEEE float32 division (not PTX's div.full), so that comparisons with the
  NumPy references hold at CPU tolerances and bits; and no
  preallocation of 75% of the GPU per process, so that several test
  processes fit on one GPU. None of these changes anything on the CPU.
* pytest-xdist (``-n auto --dist loadgroup`` in pyproject.toml): the tests
  marked with one ``xdist_group`` run in one worker process. A pytest whose
  node ids xdist cannot tag (9.2, pytest-dev/pytest-xdist#1386) would split
  them silently, so a worker refuses to start on one. ``-n auto`` starts one
  worker per core, at most 8: 8 JAX processes were measured to fit on one GPU.
"""

import os
import tempfile

os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
from heloco_jax.training import determinism  # noqa: E402  (no JAX backend starts on import)

determinism.enable()
# IEEE float32 division on NVIDIA GPUs, where XLA picks div.full (heloco_jax/comm/compress.py);
# LLVM options of other targets leave the CPU's programs as they are.
os.environ["XLA_FLAGS"] += " --xla_backend_extra_options=-nvptx-prec-divf32=2"


def _accelerator_plugin() -> bool:
  """Whether a JAX PJRT plugin (CUDA, ROCm, TPU) is installed; no backend starts."""
  from importlib import metadata, util
  return (bool(metadata.entry_points(group="jax_plugins"))
          or any(util.find_spec(name) is not None for name in ("jax_plugins", "libtpu")))


def _xla_knows(flag: str) -> bool:
  """Whether this jaxlib's XLA parses ``flag``: XLA aborts the process on an unknown one, and
  its flags come and go between releases (the flag's name is a string in jaxlib's libraries)."""
  import mmap
  import pathlib

  import jaxlib  # the package only: no backend starts
  for library in pathlib.Path(jaxlib.__file__).parent.glob("*.so"):
    with open(library, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as m:
      if m.find(flag.encode()) >= 0:
        return True
  return False


# Compile-time switches for the CPU, where they were measured; none where an accelerator's
# plugin is installed: on an H200 (jax 0.11.2, 2026-12-04) jaxlib's libraries held the string
# "xla_cpu_use_fusion_emitters" but XLA refused the flag, and every test process died.
if not _accelerator_plugin():
  # The tests' programs are tiny: compiling them is most of the suite's time, and LLVM's
  # optimisation level 0 compiles them in about 0.6× the CPU time (tests/runtime/
  # test_scheduler.py: 205 s → 142 s). It changes how fast the code runs, not what it computes.
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
  # XLA's legacy CPU fusion emitter compiles the tests' programs in about 0.35x the time of the
  # MLIR fusion emitters (a tiny heloco run: jit(run) 7.9 s -> 2.5 s, the run 31.5 s -> 15.3 s
  # on one shared core of a 2-core Xeon, 2026-12-03). Every process of the suite compiles with
  # it (subprocesses inherit XLA_FLAGS: tiny.xla_flags), so the runs a test compares agree.
  if _xla_knows("xla_cpu_use_fusion_emitters"):
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"

import jax  # noqa: E402

_CACHE = tempfile.TemporaryDirectory(prefix="heloco_jax_xla_cache_")
# Subprocesses (the kill-and-resume tests) share the cache through the environment.
os.environ.update({"JAX_COMPILATION_CACHE_DIR": _CACHE.name,
                   "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                   "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"})
jax.config.update("jax_compilation_cache_dir", _CACHE.name)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_xdist_auto_num_workers(config):
  """``-n auto``: one test process per core this process may use, at most 8."""
  del config
  return min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count() or 1)


def pytest_collection_finish(session):
  """On an xdist worker with ``--dist loadgroup``: each grouped test's node id names its group."""
  if not getattr(session.config.option, "loadgroup", False):
    return
  untagged = [item.nodeid for item in session.items
              if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
  if untagged:
    raise RuntimeError(
        f"pytest-xdist's --dist loadgroup has no effect with this pytest: {untagged[0]} is "
        "not tagged with its xdist_group (pytest-dev/pytest-xdist#1386), so module fixtures "
        "would run once per worker and Ray clusters overlap. Install the pytest that "
        "pyproject.toml's [dev] pins, or run with -n 0.")


def pytest_collection_modifyitems(config, items):
  """With xdist: the grouped tests (each group one unit of work, the longest of the suite: the
  8-device probes, Ray, the notebook) are handed out first, so that no worker ends the suite
  alone on one of them while the other idles; the order within a group, and of the rest, is
  kept."""
  if config.getoption("dist", "no") == "no":
    return
  items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)
