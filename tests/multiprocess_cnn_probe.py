"""One of 2 jax.distributed processes (2 host CPU devices each), or the reference in one
process: tests/cnn.py's flax.nnx CNN (Conv, BatchNorm, Dropout) trained with DiLoCo, a worker
per process on runtime=devices; with SHARDED "sharded", θ and the statistics given FSDP-sharded
over process 0's 2 devices. Writes θ (and the devices it came back on) and the BatchNorm
statistics as JSON from process 0 (tests/runtime/test_distributed.py compares them).

  python tests/multiprocess_cnn_probe.py COORDINATOR PROCESS_ID OUT.json [SHARDED]
  (PROCESS_ID -1: the simulated runtime in one process)
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2")
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/cnn.py

import jax  # pylint: disable=g-import-not-at-top


def main(coordinator, process_id, out, sharded=""):
  process_id = int(process_id)
  if process_id >= 0:
    jax.distributed.initialize(coordinator, num_processes=2, process_id=process_id)
  import cnn  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  import heloco_jax as hj  # pylint: disable=g-import-not-at-top
  runtime = {"runtime": hj.devices_runtime(batch_size=16)} if process_id >= 0 else {}
  # over process 0's 2 devices
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("fsdp",))
  place = ((lambda tree: cnn.fsdp_placed(tree, mesh)) if sharded == "sharded"
           else (lambda tree: tree))
  result = hj.simulate(cnn.cnn_loss, place(cnn.PARAMS), cnn.cnn_data(),
                       model_state=place(cnn.STATS),
                       method="diloco", inner_steps=4, inner_tx=optax.sgd(0.1),
                       eval_fn=cnn.cnn_eval, budget=hj.Budget(steps=48), **runtime)
  if process_id <= 0:
    values = lambda tree: [np.asarray(x).tolist() for x in jax.tree.leaves(tree)]
    with open(out, "w") as f:
      json.dump({"params": values(result.params), "model_state": values(result.model_state),
                 "devices": sorted({d.id for x in jax.tree.leaves(result.params)
                                    for d in getattr(x, "devices", lambda: ())()}),
                 "losses": [result.summary["initial_val_loss"],
                            result.summary["final_val_loss"]]}, f)


if __name__ == "__main__":
  main(*sys.argv[1:])
