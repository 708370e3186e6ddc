"""One of 2 jax.distributed processes (2 host CPU devices each), or the reference in one
process: tests/cnn.py's flax.nnx CNN (Conv, BatchNorm, Dropout) trained with DiLoCo, a worker
per process on runtime=devices; writes θ and the BatchNorm statistics as JSON from process 0
(tests/runtime/test_distributed.py compares them).

  python tests/multiprocess_cnn_probe.py COORDINATOR PROCESS_ID OUT.json   # PROCESS_ID -1: simulated
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2")
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/cnn.py

import jax  # pylint: disable=g-import-not-at-top


def main(coordinator, process_id, out):
  process_id = int(process_id)
  if process_id >= 0:
    jax.distributed.initialize(coordinator, num_processes=2, process_id=process_id)
  import cnn  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  import heloco_jax as hj  # pylint: disable=g-import-not-at-top
  runtime = {"runtime": hj.devices_runtime(batch_size=16)} if process_id >= 0 else {}
  result = hj.simulate(cnn.cnn_loss, cnn.PARAMS, cnn.cnn_data(), model_state=cnn.STATS,
                       method="diloco", inner_steps=4, inner_tx=optax.sgd(0.1),
                       eval_fn=cnn.cnn_eval, budget=hj.Budget(steps=48), **runtime)
  if process_id <= 0:
    values = lambda tree: [np.asarray(x).tolist() for x in jax.tree.leaves(jax.device_get(tree))]
    with open(out, "w") as f:
      json.dump({"params": values(result.params), "model_state": values(result.model_state),
                 "losses": [result.summary["initial_val_loss"],
                            result.summary["final_val_loss"]]}, f)


if __name__ == "__main__":
  main(*sys.argv[1:])
