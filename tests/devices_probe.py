"""Runs the devices runtime on 8 host CPU devices and prints what tests/runtime/test_devices.py checks.

Run as ``python tests/devices_probe.py OUT.json [--slow]`` (the default suite's runs, or
those of ``-m slow``; a subprocess: the device
count is fixed when JAX starts, so the test process itself cannot have 8).
"""

import asyncio
import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")
os.environ["JAX_PLATFORMS"] = "cpu"  # 8 host devices, also on a machine with one GPU
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import tiny  # pylint: disable=g-import-not-at-top

from heloco_jax.cli.configs import validation  # pylint: disable=g-import-not-at-top
from heloco_jax.lm import harness  # pylint: disable=g-import-not-at-top


def run(config):
  validation.validate(config)
  engine, _ = harness.engine_of_config(config, tiny.dataset(config.num_workers))  # the CLI's engine
  try:
    summary = asyncio.run(engine.run())
    params = [np.asarray(x).tolist() for x in jax.tree.leaves(jax.device_get(engine.params))]
    devices = sorted({d.id for x in jax.tree.leaves(engine.params) for d in x.devices()})
  finally:
    engine.close()
  return {"summary": summary, "rows": engine.rows, "params": params,
          "param_devices": devices}


def main(out, slow=False):
  budget = {"budget.tokens": 6_000, "budget.eval_every_tokens": 3_000}
  streaming = {"inner_steps": 4, "streaming.fragments": 2, "streaming.overlap_steps": 1}
  int8 = {"compression.kind": "int8", "compression.error_feedback": True}
  result = {"num_devices": jax.device_count()}
  if not slow:
    # Async HeLoCo, 4 workers × 2 devices; worker 3 waits twice its compute; θ in 2 fragments
    # (hj.Streaming) and Δ compressed with error feedback (issue 58).
    result["heloco"] = run(tiny.config("heloco", 4, runtime="devices", **budget, **streaming,
                                       **int8, **{"devices.slowdown": "1,1,1,3",
                                                  "devices.server": 7}))
    # Elastic DiLoCo rounds on the real clock: worker 1 away from the start, for good.
    result["diloco_elastic_devices"] = run(tiny.config(
        "diloco", 4, runtime="devices", **budget, **{"devices.group_sizes": "1,1,1,1",
                                                     "chaos.schedule": "1@0"}))
  else:  # -m slow: the default suite stays under 15 minutes
    # One worker on one device: its arrivals come in one order on either clock, so the split
    # compression (payload across devices) must equal the simulated runtime's bit for bit.
    one = {"budget.tokens": 2_000, "budget.eval_every_tokens": 1_000, **streaming, **int8}
    result["heloco_one_simulated"] = run(tiny.config("heloco", 1, **one))
    result["heloco_one_devices"] = run(tiny.config("heloco", 1, runtime="devices", **one,
                                                   **{"devices.group_sizes": "1"}))
    # Unequal groups (1, 1, 2, 4 devices) for an async method.
    result["mla_unequal"] = run(tiny.config("mla", 4, runtime="devices", **budget,
                                            **{"devices.group_sizes": "1,1,2,4"}))
    # Sync DiLoCo on a workers mesh (one device each, then two: the batch split over them),
    # and on the simulated runtime.
    result["diloco_simulated"] = run(tiny.config("diloco", 4, **budget))
    result["diloco_devices"] = run(tiny.config("diloco", 4, runtime="devices", **budget,
                                               **{"devices.group_sizes": "1,1,1,1"}))
    result["diloco_devices_split"] = run(tiny.config("diloco", 4, runtime="devices", **budget))
    result["diloco_elastic_simulated"] = run(tiny.config("diloco", 4, **budget,
                                                         **{"chaos.schedule": "1@0"}))
    # Compressed Streaming DiLoCo's rounds with overlap, on devices and on the simulated runtime.
    result["diloco_fragments_simulated"] = run(tiny.config("diloco", 4, **budget, **streaming,
                                                           **int8))
    result["diloco_fragments_devices"] = run(tiny.config(
        "diloco", 4, runtime="devices", **budget, **streaming, **int8,
        **{"devices.group_sizes": "1,1,1,1"}))
  with open(out, "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main(sys.argv[1], slow="--slow" in sys.argv[2:])
