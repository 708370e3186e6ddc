"""A user's flax.nnx model FSDP-sharded over 4 of 8 host CPU devices, trained with hj.simulate;
prints what tests/training/test_sharding.py checks, as JSON.

``python tests/sharding_probe.py OUT.json`` runs HeLoCo and DiLoCo sharded and unsharded;
``python tests/sharding_probe.py OUT.json METHOD WORKDIR`` runs one sharded run in WORKDIR
(checkpointing every 2 outer updates), for the kill-and-resume test. A subprocess: the device
count is fixed when JAX starts.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/cnn.py

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import optax  # pylint: disable=g-import-not-at-top
from flax import nnx  # pylint: disable=g-import-not-at-top
from jax.sharding import Mesh, NamedSharding  # pylint: disable=g-import-not-at-top

import heloco_jax as hj  # pylint: disable=g-import-not-at-top

D_IN, D_HIDDEN, K = 16, 64, 2
W_TRUE = np.random.default_rng(5).normal(size=(D_IN, 1)).astype(np.float32)


class MLP(nnx.Module):
  """Kernels and bias FSDP-sharded over the mesh's ``fsdp`` axis (flax.nnx metadata)."""

  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    self.up = nnx.Linear(
        D_IN, D_HIDDEN, kernel_init=nnx.with_partitioning(init, (None, "fsdp")),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("fsdp",)), rngs=rngs)
    self.down = nnx.Linear(D_HIDDEN, 1, kernel_init=nnx.with_partitioning(init, ("fsdp", None)),
                           use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.down(jnp.tanh(self.up(x)))


MESH = Mesh(np.array(jax.devices()[:4]), ("fsdp",))
with jax.set_mesh(MESH):
  GRAPHDEF, STATE = nnx.split(MLP(nnx.Rngs(0)))


def loss_fn(params, batch):
  x, y = batch
  state = nnx.State(STATE)
  nnx.replace_by_pure_dict(state, params)
  return jnp.mean((nnx.merge(GRAPHDEF, state)(x) - y) ** 2)


class Stream:
  """Worker i's endless non-IID regression batches."""

  def __init__(self, worker):
    self.worker = worker

  def __iter__(self):
    rng = np.random.default_rng(self.worker)
    while True:
      x = rng.normal(self.worker, 1.0, (8, D_IN)).astype(np.float32)
      yield x, x @ W_TRUE


def sharded_params():
  return nnx.to_pure_dict(STATE)  # placed by nnx.with_partitioning under jax.set_mesh


def options(method):
  """``method``'s run; "heloco_fragments": HeLoCo with θ in 2 fragments (1 step of overlap)."""
  inner_tx = (hj.palsgd_inner(optax.scale_by_adam(), 1e-2, pseudo_sync_prob=0.25)
              if method == "palsgd" else optax.adamw(1e-2))
  streaming = {}
  if method == "heloco_fragments":
    method, streaming = "heloco", dict(streaming=hj.Streaming(fragments=2, overlap_steps=1))
  return dict(method=method, inner_tx=inner_tx, inner_steps=4, speeds=[1.0, 2.0],
              budget=hj.Budget(steps=48), **streaming)


def real_clock_options(method):
  """``options(method)`` on a real clock, which refuses simulated paces (its devices' own)."""
  return {k: v for k, v in options(method).items() if k != "speeds"}


def full_copies(tree):
  """Paths of spread leaves one of whose devices holds the whole array."""
  found = []
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    if isinstance(x, jax.Array) and x.sharding.spec != jax.sharding.PartitionSpec() and any(
        shard.data.shape == x.shape for shard in x.addressable_shards):
      found.append(jax.tree_util.keystr(path))
  return found


def spread_leaves(tree):
  return sum(isinstance(x, jax.Array) and len(x.sharding.device_set) > 1
             and any(shard.data.shape != x.shape for shard in x.addressable_shards)
             for x in jax.tree.leaves(tree))


def leaves(tree):
  return [np.asarray(x).tolist() for x in jax.tree.leaves(jax.device_get(tree))]


def compare(method):
  """The sharded run's live arrays and result against the same run unsharded."""
  import asyncio  # pylint: disable=g-import-not-at-top
  engine = hj.make_engine(loss_fn, sharded_params(), [Stream(i) for i in range(K)],
                          **options(method))
  try:
    summary = asyncio.run(engine.run())
    live = {"params": engine.params, "outer_state": engine.outer_state,
            "workers": engine.state.workers,
            "pending": [job.delta for job in engine.state.jobs.values()],
            "anchors": engine.features.streaming.anchors}  # with fragments
    result_shardings = [str(x.sharding.spec) for x in jax.tree.leaves(engine.params)]
    sharded = leaves(engine.params)
  finally:
    engine.close()
  unsharded = hj.simulate(loss_fn, jax.device_get(sharded_params()),
                          [Stream(i) for i in range(K)], **options(method))
  return {"full_copies": full_copies(live), "spread": {k: spread_leaves(v)
                                                       for k, v in live.items()},
          "result_shardings": result_shardings, "sharded": sharded,
          "unsharded": leaves(unsharded.params),
          "losses": [summary["final_val_loss"] if "final_val_loss" in summary else None,
                     summary["outer_updates"]]}


def explicit_axes():
  """θ on a mesh of Explicit axes (``jax.make_mesh``'s default) runs as on the same mesh's
  Auto axes, bit for bit, and comes back on the user's mesh."""
  explicit = jax.make_mesh((4,), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,),
                           devices=jax.devices()[:4])
  params = jax.tree.map(
      lambda x: jax.device_put(x, jax.sharding.NamedSharding(explicit, x.sharding.spec)),
      sharded_params())
  on_explicit = hj.simulate(loss_fn, params, [Stream(i) for i in range(K)], **options("heloco"))
  on_auto = hj.simulate(loss_fn, sharded_params(), [Stream(i) for i in range(K)],
                        **options("heloco"))
  return {"equal": leaves(on_explicit.params) == leaves(on_auto.params),
          "axis_types": sorted({str(x.sharding.mesh.axis_types)
                                for x in jax.tree.leaves(on_explicit.params)}),
          "full_copies": full_copies(on_explicit.params)}


def on_devices(method):
  """runtime=devices: each of the 2 workers FSDP-sharded over its own 4 devices."""
  import asyncio  # pylint: disable=g-import-not-at-top
  engine = hj.make_engine(loss_fn, sharded_params(), [Stream(i) for i in range(K)],
                          runtime=hj.devices_runtime(batch_size=8), eval_fn=evaluate,
                          **real_clock_options(method))
  seen = {i: set() for i in range(K)}  # the devices each worker's live states sit on
  try:
    def look(row):
      del row
      for worker, state in enumerate(engine.state.workers or []):
        if state is not None:
          seen[worker] |= {d.id for x in jax.tree.leaves(state) for d in x.devices()}
    summary = asyncio.run(engine.run(on_row=look))
    live = {"params": engine.params, "outer_state": engine.outer_state,
            "workers": engine.state.workers}
    return {"full_copies": full_copies(live),
            "spread": {k: spread_leaves(v) for k, v in live.items()},
            "worker_devices": [sorted(seen[i]) for i in range(K)],
            "server_devices": sorted({d.id for x in jax.tree.leaves(engine.params)
                                      for d in x.devices()}),
            "result_shardings": [str(x.sharding.spec) for x in jax.tree.leaves(engine.params)],
            "losses": [summary["initial_val_loss"], summary["final_val_loss"]],
            "arrivals": summary["outer_updates"]}
  finally:
    engine.close()


def rounds_on_devices(method):
  """A synchronous method on runtime=devices: the K replicas on a workers × fsdp mesh of all
  8 devices; equal to the unsharded simulated run up to float reassociation."""
  import asyncio  # pylint: disable=g-import-not-at-top
  engine = hj.make_engine(loss_fn, sharded_params(), [Stream(i) for i in range(K)],
                          runtime=hj.devices_runtime(batch_size=8),
                          **real_clock_options(method))
  try:
    asyncio.run(engine.run())
    workers = engine.state.workers
    live = {"params": engine.params, "outer_state": engine.outer_state, "workers": workers}
    result = {"full_copies": full_copies(live),
              "worker_specs": sorted({str(x.sharding.spec) for x in jax.tree.leaves(
                  workers.params)}),
              "worker_devices": sorted({d.id for x in jax.tree.leaves(workers) for d in
                                        x.devices()}),
              "sharded": leaves(engine.params)}
  finally:
    engine.close()
  result["unsharded"] = leaves(hj.simulate(loss_fn, jax.device_get(sharded_params()),
                                           [Stream(i) for i in range(K)],
                                           **options(method)).params)
  return result


def checkpoint_across_meshes(directory):
  """A sharded tree saved from θ's 4-device mesh and restored onto a 2-device mesh."""
  from heloco_jax.rundir import checkpoint  # pylint: disable=g-import-not-at-top
  from heloco_jax.training import sharding  # pylint: disable=g-import-not-at-top
  tree = {"params": sharded_params(), "step": np.int32(3)}
  packed, layout = checkpoint.pack(tree)
  kept_sharded = sorted(name for name, x in packed.items()
                        if isinstance(x, jax.Array) and len(x.sharding.device_set) == 4)
  corrupt = dict(packed, **{kept_sharded[0]: packed[kept_sharded[0]] + 1})
  try:
    checkpoint.unpack(corrupt, layout, tree)
    corruption = None
  except ValueError as error:
    corruption = str(error)
  saver = checkpoint.Checkpointer(directory)
  saver.save(1, tree, {"note": "sharded"})
  other = sharding.layout_of(tree["params"]).on(
      Mesh(np.array(jax.devices()[4:6]), ("fsdp",)))
  template = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s),
                          tree, other.shardings(tree))
  _, restored, _ = saver.restore(lambda meta: template)
  saver.close()
  return {"kept_sharded": kept_sharded, "corruption": corruption,
          "equal": leaves(restored) == leaves(tree),
          "restored_devices": sorted({d.id for x in jax.tree.leaves(restored["params"])
                                      for d in x.devices()})}


def stopped_and_resumed_on_devices(workdir):
  """Async HeLoCo on runtime=devices (workers on their own sub-meshes) stopped at its first
  checkpoint, then resumed from it by a new engine on the same workdir."""
  import asyncio  # pylint: disable=g-import-not-at-top

  def build():
    return hj.make_engine(loss_fn, sharded_params(), [Stream(i) for i in range(K)],
                          runtime=hj.devices_runtime(batch_size=8), eval_fn=evaluate,
                          workdir=hj.Workdir(workdir, checkpoint_every=2),
                          **real_clock_options("heloco"))
  engine = build()
  try:
    def stop(e):
      e.directory.on_checkpoint(e)
      e.request_stop("the test")
    asyncio.run(engine.run(on_checkpoint=stop))
  except hj.Stopped:
    pass
  finally:
    engine.close()
  engine = build()
  try:
    resumed_from = engine.resumed_from
    summary = asyncio.run(engine.run())
  finally:
    engine.close()
  return {"resumed_from": resumed_from, "outer_updates": summary["outer_updates"],
          "losses": [summary["initial_val_loss"], summary["final_val_loss"]]}


def _cnn_run(method, sharded, runtime=None):
  """tests/cnn.py's flax.nnx CNN (Conv, BatchNorm, Dropout, accuracy in aux) with 2 fragments
  (τ = 1) and SGD (Adam would turn the ulps of near-zero gradients into steps of its learning
  rate): the engine, its live arrays, and the summary."""
  import asyncio  # pylint: disable=g-import-not-at-top
  import cnn  # pylint: disable=g-import-not-at-top
  place = (lambda tree: cnn.fsdp_placed(tree, MESH)) if sharded else (lambda tree: tree)
  engine = hj.make_engine(
      cnn.cnn_loss, place(cnn.PARAMS), cnn.cnn_data(), model_state=place(cnn.STATS),
      method=method, inner_steps=4, inner_tx=optax.sgd(0.1), eval_fn=cnn.cnn_eval,
      budget=hj.Budget(steps=48), **({"speeds": [1.0, 2.0]} if runtime is None else {}),
      streaming=hj.Streaming(fragments=2, overlap_steps=1),
      **({} if runtime is None else {"runtime": runtime}))
  try:
    summary = asyncio.run(engine.run())
    live = {"params": engine.params, "outer_state": engine.outer_state,
            "workers": engine.state.workers, "model_state": engine.model_state,
            **({"anchors": engine.features.streaming.anchors} if method == "heloco" else {})}
    copies = {"full_copies": full_copies(live), "spread": {k: spread_leaves(v)
                                                           for k, v in live.items()},
              "single_device": sum(not isinstance(x.sharding, NamedSharding)
                                   for x in jax.tree.leaves(live))} if sharded else {}
    return {**copies, "params": leaves(engine.params), "model_state": leaves(engine.model_state),
            "losses": [summary["initial_val_loss"], summary["final_val_loss"]],
            "outer_updates": summary["outer_updates"]}
  finally:
    engine.close()


def flax_cnn():
  """The CNN with θ and BatchNorm's statistics FSDP-sharded over 4 devices: HeLoCo in
  fragments (simulated) and Streaming DiLoCo on runtime=devices (the replicas on a workers ×
  fsdp mesh), each against the same run unsharded; and the unsharded HeLoCo with its workers
  spread over the 8 host devices (the test runs it on 1 device in its own process)."""
  devices = hj.devices_runtime(batch_size=16)
  return {"heloco_sharded": _cnn_run("heloco", True),
          "heloco_unsharded": _cnn_run("heloco", False),
          "diloco_devices_sharded": _cnn_run("diloco", True, devices),
          "diloco_sharded": _cnn_run("diloco", True),
          "diloco_unsharded": _cnn_run("diloco", False)}


def evaluate(params):
  x = np.random.default_rng(99).normal(0.5, 1.0, (64, D_IN)).astype(np.float32)
  return loss_fn(params, (x, x @ W_TRUE))


def in_workdir(method, workdir):
  result = hj.simulate(loss_fn, sharded_params(), [Stream(i) for i in range(K)],
                       workdir=hj.Workdir(workdir, checkpoint_every=2), **options(method))
  return {"params": leaves(result.params), "rows": result.history,
          "shardings": [str(x.sharding.spec) for x in jax.tree.leaves(result.params)]}


def main(out, method=None, workdir=None):
  if workdir is None:
    import tempfile  # pylint: disable=g-import-not-at-top
    with tempfile.TemporaryDirectory() as directory:
      saved = checkpoint_across_meshes(directory)
      resumed = stopped_and_resumed_on_devices(os.path.join(directory, "run"))
    result = {"num_devices": jax.device_count(), "checkpoint": saved,
              "devices_resumed": resumed,
              **{m: compare(m) for m in ("heloco", "diloco", "heloco_fragments")},
              "explicit_axes": explicit_axes(),
              "devices_heloco": on_devices("heloco"),
              "devices_heloco_fragments": on_devices("heloco_fragments"),
              "devices_diloco": rounds_on_devices("diloco"),
              "devices_palsgd": rounds_on_devices("palsgd"),
              "flax_cnn": flax_cnn()}
  else:
    result = in_workdir(method, workdir)
  with open(out, "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main(*sys.argv[1:])
