"""One of 2 jax.distributed processes (4 host CPU devices each): a tree sharded over all 8
devices is checkpointed (each process writing its own shards) and restored, onto the same
mesh and onto a 4 × 2 mesh; prints what tests/training/test_sharding.py checks, as JSON, from process 0.

  python tests/multiprocess_checkpoint_probe.py COORDINATOR PROCESS_ID DIRECTORY OUT.json
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
from jax.sharding import Mesh, NamedSharding  # pylint: disable=g-import-not-at-top
from jax.sharding import PartitionSpec as P


def main(coordinator, process_id, directory, out):
  jax.distributed.initialize(coordinator, num_processes=2, process_id=int(process_id))
  from heloco_jax.rundir import checkpoint  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(jax.devices()), ("fsdp",))
  values = {"w": np.arange(64 * 8, dtype=np.float32).reshape(64, 8) / 7,
            "b": np.arange(64, dtype=np.float32)}
  specs = {"w": P("fsdp", None), "b": P("fsdp")}
  tree = {"params": {k: jax.make_array_from_callback(
      v.shape, NamedSharding(mesh, specs[k]), lambda index, v=v: v[index])
      for k, v in values.items()}, "step": np.int32(7)}
  saver = checkpoint.Checkpointer(directory)
  saver.save(3, tree, {"note": "two processes"})
  result = {}
  for name, target in (("same", mesh),
                       ("other", Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tp")))):
    template = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                                   sharding=NamedSharding(target, specs[k]))
                           for k, v in values.items()},
                "step": jax.ShapeDtypeStruct((), np.int32)}
    step, restored, meta = saver.restore(lambda meta, t=template: t)
    gathered = {k: np.asarray(multihost_utils.process_allgather(x, tiled=True))
                for k, x in restored["params"].items()}
    result[name] = {"step": step, "meta": meta["note"],
                    "equal": all(np.array_equal(gathered[k], values[k]) for k in values),
                    "devices": len(restored["params"]["w"].sharding.device_set),
                    "addressable": len(restored["params"]["w"].addressable_shards)}
  saver.close()
  if jax.process_index() == 0:
    with open(out, "w") as f:
      json.dump(result, f)


if __name__ == "__main__":
  main(*sys.argv[1:])
