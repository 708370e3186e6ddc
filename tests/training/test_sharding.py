"""Shardings that follow the user's params (heloco_jax/training/sharding.py, docs/DESIGN.md "Scaling out"):
the layout rule in this process, and a flax.nnx model FSDP-sharded over 4 host CPU devices in
subprocesses (tests/sharding_probe.py) with HeLoCo and DiLoCo."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tiny
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from heloco_jax.training import sharding

pytestmark = pytest.mark.xdist_group("sharding_probe")
PROBE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sharding_probe.py")
PARAMS = {"w": jnp.ones((8, 4)), "b": jnp.ones((8,))}


def _layout():
  mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
  return sharding.Layout({"w": P(None, "fsdp"), "b": P("fsdp")}, mesh, ((8,), (8, 4)))


def test_params_on_one_device_have_no_layout():
  assert sharding.layout_of(PARAMS) is None
  assert sharding.layout_of(jax.device_get(PARAMS)) is None


def test_theta_shaped_subtrees_take_theta_specs_and_every_other_leaf_is_replicated():
  layout = _layout()
  state = optax.adam(1e-3).init(PARAMS)
  specs = jax.tree.map(lambda s: s.spec, layout.shardings(state))
  assert specs[0].count == P()
  assert specs[0].mu == specs[0].nu == {"w": P(None, "fsdp"), "b": P("fsdp")}
  stacked = jax.tree.map(lambda x: jnp.stack([x] * 3), PARAMS)  # K workers on a leading axis
  assert jax.tree.map(lambda s: s.spec, layout.shardings(stacked)) == {
      "w": P(None, None, "fsdp"), "b": P(None, "fsdp")}
  other = {"w": jnp.ones((4, 8)), "b": jnp.ones((8,))}  # θ's structure, other shapes
  assert jax.tree.map(lambda s: s.spec, layout.shardings(other)) == {"w": P(), "b": P()}
  # A fragment of θ (the other fragments' leaves None), alone, stacked, in Adam's state.
  fragment = {"w": None, "b": PARAMS["b"]}
  assert jax.tree.map(lambda s: s.spec, layout.shardings(fragment)) == {"w": None,
                                                                       "b": P("fsdp")}
  assert jax.tree.map(lambda s: s.spec, layout.shardings(
      {"w": None, "b": jnp.stack([PARAMS["b"]] * 3)})) == {"w": None, "b": P(None, "fsdp")}
  assert jax.tree.map(lambda s: s.spec, layout.shardings(optax.adam(1e-3).init(fragment)))[
      0].mu == {"w": None, "b": P("fsdp")}
  assert jax.tree.map(lambda s: s.spec, layout.shardings({"w": None, "b": jnp.ones(3)})) == {
      "w": None, "b": P()}  # other shapes: replicated


def _probe(*args, timeout=600):
  out = subprocess.run([sys.executable, PROBE, *args], capture_output=True, text=True,
                       timeout=timeout, check=False)
  assert out.returncode == 0, out.stderr[-3000:]


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
  out = tmp_path_factory.mktemp("sharding") / "out.json"
  _probe(str(out))
  with open(out) as f:
    return json.load(f)


@pytest.mark.parametrize("method", ["heloco", "diloco", "heloco_fragments"])
def test_no_device_holds_a_full_copy_and_the_result_equals_the_unsharded_run(probe, method):
  """heloco_fragments (issue 58): θ in 2 fragments, each fragment's server holding its leaves
  with θ's specs, the workers' anchors and pending fragment Δs too."""
  assert probe["num_devices"] == 8
  run = probe[method]
  # θ, the outer state and the workers' states are spread, leaf by leaf, on the live arrays.
  assert run["full_copies"] == []
  assert run["spread"]["params"] == 3 and run["spread"]["outer_state"] >= 3
  # θ and Adam's two moments per worker where they are kept (rounds, fragments); an
  # asynchronous worker keeps only its carry, nothing of θ's size (DESIGN.md, "Memory per
  # worker").
  assert run["spread"]["workers"] == 0 if method == "heloco" else run["spread"]["workers"] >= 9
  if method == "heloco_fragments":  # the 2 workers' anchors: a θ each
    assert run["spread"]["anchors"] == 6
  # result.params keeps the user's shardings (not gathered to the host).
  assert sorted(run["result_shardings"]) == sorted(
      ["P('fsdp',)", "P('fsdp', None)", "P(None, 'fsdp')"])
  for sharded, unsharded in zip(run["sharded"], run["unsharded"], strict=True):
    sharded, unsharded = np.asarray(sharded), np.asarray(unsharded)
    assert np.linalg.norm(sharded - unsharded) <= 1e-5 * np.linalg.norm(unsharded)


def test_a_mesh_of_explicit_axes_runs_as_its_auto_axes_and_the_result_stays_on_it(probe):
  """``jax.make_mesh`` gives Explicit axes; the engine runs θ on the same devices and specs
  with Auto axes (its outer rules' dot products need XLA to partition them) and hands θ back
  on the user's mesh."""
  run = probe["explicit_axes"]
  assert run["equal"] and run["full_copies"] == []
  assert run["axis_types"] == ["(Explicit,)"]


def _steps(workdir):
  directory = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit()) if os.path.isdir(
      directory) else []


def _without_wall_clock(rows):
  return [{k: v for k, v in row.items() if k not in ("wall_seconds", "tokens_per_second")}
          for row in rows]


@pytest.mark.parametrize("method", ["heloco", pytest.param("diloco", marks=pytest.mark.slow),
                                    pytest.param("heloco_fragments", marks=pytest.mark.slow)])
def test_a_sharded_run_killed_mid_run_resumes_exactly(tmp_path, method):
  reference = tmp_path / "reference.json"
  _probe(str(reference), method, str(tmp_path / "uninterrupted"))
  workdir = str(tmp_path / "killed")
  process = subprocess.Popen([sys.executable, PROBE, str(tmp_path / "unused.json"), method,
                              workdir], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  deadline = time.monotonic() + 300
  while len(_steps(workdir)) < 2 and process.poll() is None and time.monotonic() < deadline:
    time.sleep(0.02)
  process.send_signal(signal.SIGKILL)
  _, err = process.communicate()
  assert process.returncode == -signal.SIGKILL, err.decode()[-2000:]
  resumed = tmp_path / "resumed.json"
  _probe(str(resumed), method, workdir)
  with open(reference) as f:
    expected = json.load(f)
  with open(resumed) as f:
    got = json.load(f)
  assert got["params"] == expected["params"]  # bit for bit
  assert _without_wall_clock(got["rows"]) == _without_wall_clock(expected["rows"])
  assert got["shardings"] == expected["shardings"]


@pytest.mark.parametrize("method", ["heloco", "heloco_fragments"])
def test_on_devices_each_worker_is_sharded_over_its_own_group_and_the_run_learns(probe, method):
  run = probe[f"devices_{method}"]
  assert run["worker_devices"] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # sub-meshes of θ's shape
  assert run["server_devices"] == [0, 1, 2, 3]  # θ where the user put it
  assert run["full_copies"] == []
  assert run["spread"]["outer_state"] >= 3
  assert run["spread"]["workers"] == 0 if method == "heloco" else run["spread"]["workers"] >= 18
  assert sorted(run["result_shardings"]) == sorted(
      ["P('fsdp',)", "P('fsdp', None)", "P(None, 'fsdp')"])
  assert run["arrivals"] > 0 and run["losses"][1] < 0.2 * run["losses"][0]


def test_an_async_run_on_devices_stopped_at_a_checkpoint_resumes_and_learns(probe):
  run = probe["devices_resumed"]
  assert run["resumed_from"] == 2 and run["outer_updates"] == 12  # its whole budget
  assert run["losses"][1] < 0.2 * run["losses"][0]


@pytest.mark.parametrize("method", ["diloco", "palsgd"])
def test_rounds_on_devices_split_the_replicas_over_workers_and_equal_the_simulated_run(
    probe, method):
  run = probe[f"devices_{method}"]
  assert run["full_copies"] == []
  assert run["worker_devices"] == list(range(8))  # K = 2 replicas × 4-way FSDP
  assert all(spec.startswith("P('workers'") for spec in run["worker_specs"]), run
  for sharded, unsharded in zip(run["sharded"], run["unsharded"], strict=True):
    sharded, unsharded = np.asarray(sharded), np.asarray(unsharded)
    assert np.linalg.norm(sharded - unsharded) <= 1e-5 * np.linalg.norm(unsharded)


def _flat(tree):
  return np.concatenate([np.ravel(np.asarray(x)) for x in tree])


def test_a_flax_cnn_sharded_with_its_batchnorm_statistics_equals_the_unsharded_run(probe):
  """Issue 58: tests/cnn.py's flax.nnx CNN (Conv, BatchNorm, Dropout keyed per step) with θ
  FSDP-sharded over 4 devices and its BatchNorm statistics given sharded; 2 fragments (τ = 1):
  HeLoCo (simulated) and Streaming DiLoCo, simulated and on runtime=devices (the replicas on a
  workers × fsdp mesh). Every array stays on the mesh and no device holds a whole sharded leaf
  (θ, the outer state, the workers' states, the anchors; the statistics are replicated); θ
  and the statistics equal the unsharded run within float reassociation (SGD: Adam turns the
  ulps of near-zero gradients into steps of its learning rate). Before: runtime=devices ended
  at 0.325 for 0.536 (XLA's Shardy partitioner miscompiles a vmapped convolution whose kernel
  is split over workers and output channels, jax 0.10–0.12; rounds now run one worker per
  slice: ``InnerLoop`` with ``spmd_axis_name``)."""
  runs = probe["flax_cnn"]
  for name in ("heloco_sharded", "diloco_sharded", "diloco_devices_sharded"):
    run = runs[name]
    assert run["full_copies"] == [] and run["single_device"] == 0, (name, run)
    assert run["spread"]["params"] == 5 and run["spread"]["workers"] >= 5  # 5 of 6 leaves split
    assert run["losses"][1] < 0.4 * run["losses"][0], run["losses"]
  assert runs["heloco_sharded"]["spread"]["anchors"] == 10  # 2 workers' anchors
  for sharded, unsharded in (("heloco_sharded", "heloco_unsharded"),
                             ("diloco_sharded", "diloco_unsharded"),
                             ("diloco_devices_sharded", "diloco_unsharded")):
    assert runs[sharded]["outer_updates"] == runs[unsharded]["outer_updates"] > 10
    for key in ("params", "model_state"):
      a, b = _flat(runs[sharded][key]), _flat(runs[unsharded][key])
      assert np.linalg.norm(a - b) <= 1e-6 * np.linalg.norm(b), (sharded, key)
  # The replicas on the workers × fsdp mesh compute what the simulated runtime does, bit for bit.
  assert runs["diloco_devices_sharded"]["params"] == runs["diloco_sharded"]["params"]


def test_a_model_state_with_workers_spread_over_host_devices_equals_one_device(probe):
  """The simulated runtime runs worker i on device i mod 8 (host CPU devices here): the
  BatchNorm statistics a worker brings back are merged on θ's device. Before: "incompatible
  devices" at the first arrival. The result equals this process's one device, bit for bit
  (within float rounding where this process runs on an accelerator: measured 2e-6 relative
  on an H200)."""
  import cnn  # pylint: disable=g-import-not-at-top
  import heloco_jax as hj  # pylint: disable=g-import-not-at-top
  one = hj.simulate(cnn.cnn_loss, cnn.PARAMS, cnn.cnn_data(), model_state=cnn.STATS,
                    method="heloco", inner_steps=4, inner_tx=optax.sgd(0.1),
                    eval_fn=cnn.cnn_eval, budget=hj.Budget(steps=48), speeds=[1.0, 2.0],
                    streaming=hj.Streaming(fragments=2, overlap_steps=1))
  spread = probe["flax_cnn"]["heloco_unsharded"]
  for key, tree in (("params", one.params), ("model_state", one.model_state)):
    ours = [np.asarray(x).tolist() for x in jax.tree.leaves(tree)]
    if jax.default_backend() == "cpu":
      assert spread[key] == ours, key
    else:
      for a, b in zip(spread[key], ours, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=key)


def test_two_processes_checkpoint_their_own_shards_and_restore_onto_two_meshes(tmp_path):
  """jax.distributed on loopback, 2 processes × 4 host CPU devices (tests/
  multiprocess_checkpoint_probe.py): orbax writes each process's shards; restored onto the
  8-device mesh and onto a 4 × 2 one, the values equal what was saved."""
  probe = os.path.join(os.path.dirname(PROBE), "multiprocess_checkpoint_probe.py")
  out = tmp_path / "out.json"
  coordinator = f"127.0.0.1:{tiny.free_port()}"
  codes, outputs = tiny.run_processes(
      [[sys.executable, probe, coordinator, str(i), str(tmp_path / "checkpoints"), str(out)]
       for i in range(2)])
  assert codes == [0, 0], [o[-2000:] for o in outputs]
  with open(out) as f:
    result = json.load(f)
  for mesh in ("same", "other"):
    assert result[mesh]["equal"] and result[mesh]["step"] == 3, result
    assert result[mesh]["devices"] == 8 and result[mesh]["addressable"] == 4  # global arrays


CLI_TINY = ["--config.model.d_model=32", "--config.model.num_layers=1",
            "--config.model.context=16", "--config.batch_size=4", "--config.inner_steps=2",
            "--config.data.max_bytes_per_language=40000",
            "--config.data.val_sequences_per_language=8", "--config.budget.tokens=6000",
            "--config.num_workers=3", "--config.checkpoint.every=10"]


def _cli(workdir, *args):
  env = {**os.environ, "XLA_FLAGS": tiny.xla_flags(4),
         "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-m", "heloco_jax.cli.train", f"--workdir={workdir}",
                         *CLI_TINY, *args], env=env, capture_output=True, text=True,
                        timeout=600, check=False)


@pytest.mark.slow  # 50–120 s: the default suite stays under 15 minutes
def test_the_cli_gpt_sharded_over_4_devices_ends_as_the_unsharded_run(tmp_path):
  runs = {sharding_: _cli(tmp_path / sharding_, f"--config.model.sharding={sharding_}")
          for sharding_ in ("none", "fsdp", "fsdp_tp")}
  for out in runs.values():
    assert out.returncode == 0, out.stderr[-3000:]
  assert "θ sharded over {'fsdp': 4}" in runs["fsdp"].stderr
  assert "θ sharded over {'fsdp': 2, 'tp': 2}" in runs["fsdp_tp"].stderr
  losses = {}
  for name in runs:
    with open(tmp_path / name / "summary.json") as f:
      losses[name] = json.load(f)["final_val_loss"]
  for name in ("fsdp", "fsdp_tp"):  # float reassociation over 46 updates: measured ≤ 1.5e-4
    assert abs(losses[name] - losses["none"]) <= 1e-3 * abs(losses["none"]), losses
  assert (tmp_path / "fsdp" / "checkpoints").is_dir()  # a sharded checkpoint was written


RAY_SHARDED = ["--config.model.sharding=fsdp", "--config.runtime=ray", "--config.ray.num_cpus=2",
               "--config.num_workers=1", "--config.budget.tokens=3000",
               "--config.checkpoint.every=5", "--config.budget.eval_every_tokens=512"]


def _rows(workdir):
  with open(workdir / "metrics.jsonl") as f:
    return [json.loads(line) for line in f]


def _eval_losses(workdir):
  return [row["val_loss"] for row in _rows(workdir) if row["event"] == "eval"]


# int8 + error feedback up, int8 down: both actors keep x̂ on their mesh (issue 58); and θ in
# 2 fragments, each fragment's server actor holding its leaves with θ's specs.
COMPRESSED = ["--config.compression.kind=int8", "--config.compression.download=True"]
FRAGMENTS = ["--config.streaming.fragments=2", *COMPRESSED]
RAY_VARIANTS = dict(argvalues=[[], COMPRESSED, FRAGMENTS],
                    ids=["none", "int8_both_ways", "fragments_int8_both_ways"])


@pytest.mark.slow  # 30–80 s: the default suite stays under 15 minutes
@pytest.mark.parametrize("compression", **RAY_VARIANTS)
def test_the_cli_gpt_sharded_on_ray_actors_equals_the_sharded_simulated_run(tmp_path,
                                                                            compression):
  """HeLoCo with θ FSDP-sharded over 4 devices in the driver, in the server actor and in the
  worker actor (one worker: the arrival order is the simulated one) gives the sharded
  simulated run's evaluations bit for bit, uncompressed, with compressed syncs both ways, and
  so in 2 fragments; checkpoints are written (by the driver, from θ's shards, x̂ among them)."""
  pytest.importorskip("ray")
  ray_run = _cli(tmp_path / "ray", *RAY_SHARDED, *compression)
  assert ray_run.returncode == 0, ray_run.stderr[-3000:]
  assert "θ sharded over {'fsdp': 4} in each actor" in ray_run.stderr
  simulated = _cli(tmp_path / "simulated", RAY_SHARDED[0], *RAY_SHARDED[3:], *compression)
  assert simulated.returncode == 0, simulated.stderr[-3000:]
  ray_losses, simulated_losses = _eval_losses(tmp_path / "ray"), _eval_losses(tmp_path / "simulated")
  assert len(ray_losses) == len(simulated_losses) > 3
  assert ray_losses == simulated_losses  # the same programs on a mesh of the same shape
  assert ray_losses[-1] < ray_losses[0] - 1.0
  downs = [[row["bytes_down"] for row in _rows(tmp_path / name) if row["event"] == "arrival"]
           for name in ("ray", "simulated")]
  assert downs[0] == downs[1]
  if compression == COMPRESSED:  # θ whole first, then the message: about a quarter of θ's
    assert max(downs[0][1:]) < downs[0][0] / 3.9, downs[0]
  if compression == FRAGMENTS:  # θ whole first, then a fragment's message
    assert max(downs[0][1:]) < downs[0][0] / 3.9 and len(set(downs[0][1:])) == 2, downs[0]
  assert sorted(os.listdir(tmp_path / "ray" / "checkpoints"))


@pytest.mark.slow
@pytest.mark.parametrize("compression", **RAY_VARIANTS)
def test_a_sharded_ray_run_stopped_after_a_checkpoint_resumes_to_the_same_end(tmp_path,
                                                                             compression):
  """SIGTERM after the first checkpoint stops the run at its next arrival (exit 143); the same
  command resumes it (θ and the outer state back into the server actor, the worker's state
  and, with compressed downloads, its x̂ into both actors, shard by shard) and it ends with
  the uninterrupted run's evaluations."""
  pytest.importorskip("ray")
  whole = _cli(tmp_path / "whole", *RAY_SHARDED, *compression)
  assert whole.returncode == 0, whole.stderr[-3000:]
  env = {**os.environ, "XLA_FLAGS": tiny.xla_flags(4),
         "JAX_PLATFORMS": "cpu"}
  stopped = tmp_path / "stopped"
  proc = subprocess.Popen([sys.executable, "-m", "heloco_jax.cli.train", f"--workdir={stopped}",
                           *CLI_TINY, *RAY_SHARDED, *compression], env=env,
                          stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  try:
    deadline = time.monotonic() + 600
    while not (stopped / "checkpoints" / "5" / "meta").exists():
      assert time.monotonic() < deadline and proc.poll() is None
      time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 143
  finally:
    proc.kill()
  assert not (stopped / "summary.json").exists()
  resumed = _cli(stopped, *RAY_SHARDED, *compression)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resuming from checkpoint" in resumed.stderr
  assert _eval_losses(stopped) == _eval_losses(tmp_path / "whole")
