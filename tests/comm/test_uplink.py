"""heloco_jax/comm/uplink.py: a round's compressed Δ on a mesh (``runtime="devices"``, across
processes too): each worker sends where its end is and only the messages cross, all-gathered
over ``workers`` (docs/ALGORITHMS.md, "Compression in a run"). Checked on 4 host CPU devices in
a subprocess (this module run as a script): the same bits as the one program the simulated
runtime runs, and the bytes each worker's messages put on the collective, read from the
compiled program."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

# One worker process runs this module, so the 4-device probe runs once.
pytestmark = pytest.mark.xdist_group("uplink_probe")
# kind, options, whether the codes cross as the payload counts them (int4: one byte per
# 4-bit code, unpacked; nbytes counts them packed)
CASES = [("int8", {"block": 64}, True), ("fp8", {}, True), ("bf16", {}, True),
         ("top_k", {"fraction": 0.05}, True), ("int4", {"block": 64}, False)]
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "u16": 2, "bf16": 2, "s32": 4,
             "u32": 4, "f32": 4}


def _gathered_bytes(hlo: str) -> tuple[int, list[str]]:
  """The bytes all-gathered by a compiled program, and its other collectives."""
  total, others = 0, []
  for line in hlo.splitlines():
    match = re.search(r"= (\w+)\[([\d,]*)\]\S* all-gather\(", line)
    if match:
      total += _ITEMSIZE[match.group(1)] * int(np.prod([int(d) for d in match.group(2).split(",")
                                                        if d]))
    elif re.search(r"all-reduce\(|all-to-all\(|collective-permute\(|reduce-scatter\(", line):
      others.append(line.strip()[:120])
  return total, others


def _probe() -> dict:
  """Runs where 4 host CPU devices exist: per case, whether ``round_delta`` on a mesh equals
  the one program bit for bit (a 4 × 1 ``workers`` × ``data`` mesh, and 2 workers with θ
  sharded over a 2-device axis), and what the 4 × 1 program gathers."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from heloco_jax.comm import compress, fragments, uplink

  params = {"w": jnp.linspace(-1.0, 1.0, 512).reshape(16, 32), "b": jnp.ones(64)}
  rng = np.random.default_rng(0)
  out = {}
  for kind, options, _ in CASES:
    compressor = compress.by_name(kind, error_feedback=True, **options)
    link = uplink.Uplink(compressor, params, fragments.split(params, 1, "contiguous"))
    result = {"payload": link.bytes_up[0]}
    for k, axes, spec in ((4, ("workers", "data"), P("workers")),
                          (2, ("workers", "fsdp"), P("workers", "fsdp"))):
      mesh = Mesh(np.array(jax.devices()[:4]).reshape(k, 4 // k), axes)
      ends = jax.tree.map(lambda x, k=k: np.stack(
          [np.asarray(x) + rng.normal(size=x.shape).astype(np.float32) for _ in range(k)]),
          params)
      accepted = np.arange(k) != 1  # worker 1 rejected: dropped from the mean
      states = link.init(params, k, stacked=True)[0]
      for _ in range(2):  # the second round starts from the residuals of the first
        want = link.round_delta(params, ends, accepted, states)
        put = lambda tree, s, mesh=mesh: jax.device_put(tree, NamedSharding(mesh, s))
        args = (put(params, P()), {"w": put(ends["w"], spec), "b": put(ends["b"], P("workers"))},
                put(accepted, P()), put(states, P("workers")))
        got = link.round_delta(*args, mesh=mesh)
        same = all(np.array_equal(a, b, equal_nan=True)
                   for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)))
        result[f"same_bits_{'x'.join(axes)}"] = result.get(f"same_bits_{'x'.join(axes)}",
                                                           True) and same
        states = want[1]
        ends = jax.tree.map(lambda x: x * 0.5, ends)
      if axes[1] == "data":
        hlo = link._exchanges[mesh].lower(*args).compile().as_text()
        result["gathered"], result["other_collectives"] = _gathered_bytes(hlo)
    out[kind] = result
  return out


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
  path = tmp_path_factory.mktemp("uplink") / "probe.json"
  env = {**os.environ, "XLA_FLAGS": os.environ["XLA_FLAGS"]
         + " --xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
  subprocess.run([sys.executable, __file__, str(path)], env=env, check=True, timeout=300)
  return json.loads(path.read_text())


@pytest.mark.parametrize("kind", [case[0] for case in CASES])
def test_a_round_on_a_mesh_is_the_one_program_bit_for_bit(probe, kind):
  """The received mean and the workers' next residuals, two rounds running, one worker
  rejected; θ replicated (4 workers), and θ sharded over each worker's 2 devices."""
  assert probe[kind]["same_bits_workersxdata"]
  assert probe[kind]["same_bits_workersxfsdp"]


@pytest.mark.parametrize("kind, exact", [(case[0], case[2]) for case in CASES])
def test_only_the_messages_cross_between_workers(probe, kind, exact):
  """What the program gathers per worker is its payload (``payload_nbytes``: the codes and
  scales, the indices and values, bf16 in 2 bytes) and the two flags; no other collective
  (no float32 all-reduce of Δ). int4's codes cross one byte each (unpacked)."""
  result = probe[kind]
  assert result["other_collectives"] == []
  per_worker = result["gathered"] // 4 - 2  # the NaN and ±Inf flags: a byte each
  if exact:
    assert per_worker == result["payload"]
  else:
    scales = 9 * 4  # 8 + 1 blocks of 64
    assert per_worker - scales == 2 * (result["payload"] - scales)


if __name__ == "__main__":
  with open(sys.argv[1], "w") as f:
    json.dump(_probe(), f)
