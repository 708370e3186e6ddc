"""Every CPU performance figure (issues 8 and 21), measured side by side in one run.

  1. Simulator overhead: async HeLoCo simulation tokens/s ÷ bare compiled
     inner loop tokens/s (``simulator_overhead.overhead``); target >= 0.9.
  2. Outer step: heloco ÷ mla per update on the 14.5M-parameter tree
     (``outer_step.time_rules``); target <= 1.5.
  3. Scale: wall time and peak RSS for K = 5, 16, 64 at a fixed token budget
     (``simulator_overhead.scaling``); target <= 1.2x.
  4. Against PyTorch: the same simulation in ``torch_reference.py`` (run by
     the Python of its own environment, ``--torch-python``) ÷ heloco_jax's
     tokens/s from 1.; target >= 2. Skipped, with the set-up command, when no
     such environment exists.
  5. Compile time of the quickstart, cold and from the persistent cache
     (``compile_time``); target < 30 s.
  6. Host CPU devices: the K = 5 run on 1, 2 and (when more) all cores' host
     devices (``simulator_overhead.host_devices``).
  7. The HeLoCo outer step against the authors' style in PyTorch (a Python
     loop over tensors, ``torch_outer_step.py``) on the same 14.5M tree;
     target >= 2x.
  8. A user's model (``users_model``): a flax.nnx CNN's own ``nnx.jit`` loop ÷ the same
     steps through ``hj.simulate``, K = 1 and 5; targets >= 0.9 and >= 0.8.

Thread counts: JAX's XLA:CPU runs each program over all the machine's
cores; PyTorch's count is printed with its figures (its default: the cores).
The GPU figures are ``benchmarks/device_step.py``'s (``benchmarks/gpu.sh``);
on a machine without an accelerator they are not measured here.

  python -m benchmarks.all [--quick] [--torch-python /tmp/torch_env/bin/python]

``--quick`` shortens every part (fewer dispatches, repeats and tokens) for a
smoke run; its figures are noisier. The last line is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

import jax

from benchmarks import outer_step, simulator_overhead, users_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_SETUP = ("python3 -m venv /tmp/torch_env && /tmp/torch_env/bin/pip install "
               "-r benchmarks/torch_requirements.txt")


def machine() -> str:
  """The machine in one line: CPU model and cores, memory, JAX devices."""
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  memory = ""
  try:
    with open("/proc/meminfo") as f:
      kib = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
    memory = f", {kib / 2 ** 20:.0f} GiB RAM"
  except (OSError, StopIteration, ValueError):
    pass
  devices = jax.devices()
  return (f"{cpu}, {os.cpu_count()} cores{memory}; jax {jax.__version__}, "
          f"{len(devices)} x {devices[0].device_kind} ({jax.default_backend()})")


def _torch(python: str, dispatches: int) -> dict:
  out = subprocess.run([python, os.path.join(ROOT, "benchmarks", "torch_reference.py"),
                        f"--dispatches={dispatches}"], capture_output=True, text=True, check=True)
  lines = out.stdout.strip().splitlines()
  return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--torch-python", default="/tmp/torch_env/bin/python")
  args = parser.parse_args()
  dispatches, repeats, tokens = (8, 5, 100_000) if args.quick else (40, 30, 400_000)
  print(f"# machine: {machine()}")
  results: dict = {"machine": machine()}

  print("\n## 1. simulator overhead")
  results["overhead"] = simulator_overhead.overhead(dispatches)

  print("\n## 2. outer step, TinyGPT-shaped tree with vocabulary 50257 (14.5M parameters)")
  medians = outer_step.time_rules(50257, repeats)
  for name, seconds in medians.items():
    print(f"  {name:18s} {seconds * 1e3:9.3f} ms / update")
  ratio = medians["heloco"] / medians["mla"]
  print(f"ratio heloco / mla        {ratio:9.3f}  (target <= 1.5)")
  results["outer_step_ms"] = {name: s * 1e3 for name, s in medians.items()}
  results["outer_step_ratio"] = ratio

  print("\n## 3. scale")
  results["scaling"] = simulator_overhead.scaling([5, 16, 64], tokens)

  print("\n## 4. against PyTorch (torch_reference.py, same run, same dispatches)")
  if os.path.exists(args.torch_python):
    torch = _torch(args.torch_python, dispatches)
    jax_rate = results["overhead"]["simulation_tokens_per_second"]
    print(f"PyTorch simulation        {torch['tokens_per_second']:9.0f} tokens/s "
          f"(torch {torch['torch']}, {torch['threads']} threads)")
    print(f"heloco_jax simulation     {jax_rate:9.0f} tokens/s (from 1.)")
    print(f"ratio heloco_jax / torch  {jax_rate / torch['tokens_per_second']:9.3f}  "
          "(target >= 1.0, stretch 1.3)")
    results["torch"] = {"tokens_per_second": torch["tokens_per_second"],
                        "ratio": jax_rate / torch["tokens_per_second"],
                        "torch": torch["torch"], "threads": torch["threads"]}
  else:
    print(f"skipped: no {args.torch_python}; set it up with\n  {TORCH_SETUP}")

  print("\n## 6. host CPU devices")
  counts = sorted({1, 2, os.cpu_count() or 1})
  results["host_devices"] = simulator_overhead.host_devices(counts, tokens // 2)

  print("\n## 7. HeLoCo outer step against the authors' per-tensor PyTorch loop")
  if os.path.exists(args.torch_python):
    out = subprocess.run([args.torch_python, os.path.join(ROOT, "benchmarks",
                                                          "torch_outer_step.py"),
                          f"--repeats={repeats}"], capture_output=True, text=True, check=True)
    torch_outer = json.loads(out.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    jax_ms = results["outer_step_ms"]["heloco"]
    ratio = torch_outer["seconds_per_update"] * 1e3 / jax_ms
    print(f"PyTorch per tensor        {torch_outer['seconds_per_update'] * 1e3:9.3f} ms / update "
          f"({torch_outer['threads']} threads)")
    print(f"heloco_jax (from 2.)      {jax_ms:9.3f} ms / update")
    print(f"speed-up                  {ratio:9.2f}x  (target >= 2)")
    results["outer_vs_torch"] = {"torch_ms": torch_outer["seconds_per_update"] * 1e3,
                                 "jax_ms": jax_ms, "speedup": ratio,
                                 "threads": torch_outer["threads"]}
  else:
    print(f"skipped: no {args.torch_python}; set it up with\n  {TORCH_SETUP}")

  print("\n## 8. a user's model: its own nnx.jit loop ÷ hj.simulate (CPU seconds per step)")
  results["users_model"] = users_model.compare(steps=300 if args.quick else 600)

  print("\n## 5. compile time")
  out = subprocess.run([sys.executable, "-m", "benchmarks.compile_time"], capture_output=True,
                       text=True, check=True, cwd=ROOT)
  lines = out.stdout.strip().splitlines()
  print("\n".join(line for line in lines[1:-1]))
  results["compile"] = json.loads(lines[-1].removeprefix("RESULT "))

  print("\nRESULT " + json.dumps(results))


if __name__ == "__main__":
  main()
