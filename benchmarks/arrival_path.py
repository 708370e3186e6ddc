"""What one arrival crosses: the package's files and functions between two arrival rows.

  python -m benchmarks.arrival_path            # this checkout
  PYTHONPATH=OTHER python -m benchmarks.arrival_path   # another checkout, the same problem

A HeLoCo run of 3 simulated workers on a small regression; the profiler records
every call into ``heloco_jax/`` between the 20th and the 21st arrival rows (well
after compilation) and prints the distinct files, the distinct functions and
the moves from one file to another (a call or a return that changes file).
"""

import os
import sys

import jax.numpy as jnp
import numpy as np
import optax

import heloco_jax as hj
from heloco_jax.runtime import state

W = np.array([[1.0], [-2.0], [0.5]], np.float32)


def _loss(params, batch):
  x, y = batch
  return jnp.mean((x @ params["w"] - y) ** 2)


def _stream(worker):
  rng = np.random.default_rng(worker)
  while True:
    x = rng.normal(worker, 1.0, (8, 3)).astype(np.float32)
    yield x, x @ W


def main() -> None:
  package = os.path.dirname(hj.__file__)
  events, arrivals = [], [0]
  emit = state.Recorder.emit

  def counting_emit(self, row):
    if row["event"] == "arrival":
      arrivals[0] += 1
    return emit(self, row)
  state.Recorder.emit = counting_emit

  def profile(frame, event, arg):
    del arg
    if event in ("call", "return") and 20 <= arrivals[0] < 21:
      path = frame.f_code.co_filename
      if path.startswith(package):
        events.append((event, os.path.relpath(path, package), frame.f_code.co_qualname))
  sys.setprofile(profile)
  try:
    hj.simulate(_loss, {"w": jnp.zeros((3, 1))}, [_stream(i) for i in range(3)],
                method="heloco", inner_tx=optax.sgd(0.01), inner_steps=4,
                speeds=[1.0, 2.0, 3.0], budget=hj.Budget(steps=400), metrics_fetch_every=1)
  finally:
    sys.setprofile(None)
  files = {f for _, f, _ in events}
  functions = {(f, q) for _, f, q in events}
  moves = sum(1 for a, b in zip(events, events[1:]) if a[1] != b[1])
  print(f"one arrival crosses {len(files)} files, {len(functions)} functions, "
        f"{moves} file-to-file moves")
  pairs: dict = {}
  for a, b in zip(events, events[1:]):
    if a[1] != b[1]:
      pair = tuple(sorted((a[1], b[1])))
      pairs[pair] = pairs.get(pair, 0) + 1
  print("moves by pair of files: " + ", ".join(
      f"{x} <-> {y}: {n}" for (x, y), n in sorted(pairs.items(), key=lambda kv: -kv[1])))
  for name in sorted(files):
    print(f"  {name}: " + ", ".join(sorted(q for f, q in functions if f == name)))


if __name__ == "__main__":
  main()
