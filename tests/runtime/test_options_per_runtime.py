"""No option is silently ignored (issue 77): every keyword of ``hj.make_engine`` on a real clock
(``runtime=devices``, this process's one device) either takes effect or is refused in one line
naming it. The table is checked against make_engine's signature: a new keyword fails here until
it is classified."""

import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import heloco_jax as hj


def _loss(params, batch):
  return jnp.mean((batch @ params["w"] - 1.0) ** 2)


def _stream(seed=0):
  rng = np.random.default_rng(seed)
  while True:
    yield rng.normal(0, 1, (4, 8)).astype(np.float32)


PARAMS = {"w": np.zeros((8, 1), np.float32)}
BASE = dict(method="heloco", inner_tx=optax.sgd(0.05), inner_steps=2, budget=hj.Budget(steps=8),
            runtime=hj.devices_runtime(batch_size=4))

# keyword -> (a value other than its default, what a real clock does with it: "runs" (and the
# check of its effect, or None), "refused", or where another test covers it).
TABLE = {
    "loss_fn": ("structural", None, "every run"),
    "params": ("structural", None, "every run"),
    "data": ("structural", None, "every run"),
    "budget": ("structural", None, "every run"),
    "runtime": ("structural", None, "every run of this table"),
    "method": ("runs", "mla", lambda r: r.summary["method"] == "mla"),
    "inner_steps": ("runs", 4, lambda r: r.summary["outer_updates"] == 2),
    "speeds": ("refused", "severe", None),
    "eval_fn": ("runs", jax.jit(lambda p: _loss(p, np.ones((4, 8), np.float32))),
                lambda r: r.summary["final_val_loss"] is not None),
    "seed": ("runs", 1, lambda r: r.summary["seed"] == 1),
    "outer_tx": ("runs", hj.heloco(1e-9, num_workers=1),
                 lambda r: np.abs(r.params["w"]).max() < 1e-6),
    "inner_tx": ("runs", optax.sgd(0.0), lambda r: np.all(r.params["w"] == 0)),
    "method_options": ("runs", {"learning_rate": 1e-9},
                       lambda r: np.abs(r.params["w"]).max() < 1e-6),
    "reset_optimizer": ("runs", False, None),
    "syncer": ("runs", hj.Syncer(quorum=1, timeout=1.0), None),
    "streaming": ("runs", hj.Streaming(fragments=1), None),
    "compress": ("runs", hj.compress.int8(),
                 lambda r: r.summary["bytes_sent"] < 4 * 8 * 2 * r.summary["outer_updates"]),
    "membership": ("runs", hj.Membership(((0, 0.0, math.inf),)), "refused_all_away"),
    "comm": ("runs", hj.CommModel(latency=0.01), lambda r: r.summary["network_seconds"] > 0),
    "jitter": ("refused", 0.2, None),
    "model_state": ("elsewhere", None, "tests/training/test_model_state.py (a state loss_fn)"),
    "model_state_merge": ("elsewhere", None, "tests/training/test_model_state.py"),
    "workdir": ("elsewhere", None, "tests/runtime/test_devices.py, tests/rundir"),
    "deterministic": ("runs", False, None),
    "rejection_limit": ("runs", 3, None),
    "metrics_fetch_every": ("runs", 1, None),
    "on_row": ("runs", lambda row: None, None),
    "handle_signals": ("runs", True, None),
}


def test_every_make_engine_keyword_is_in_the_table():
  assert set(TABLE) == set(inspect.signature(hj.make_engine).parameters)


@pytest.mark.parametrize("name", [n for n, (kind, _, _) in TABLE.items()
                                  if kind in ("runs", "refused")])
def test_each_option_on_a_real_clock_takes_effect_or_is_refused_in_one_line(name):
  kind, value, check = TABLE[name]
  options = {**BASE, name: value}
  if check == "refused_all_away":  # one worker away from the start: refused as a schedule
    with pytest.raises(ValueError, match="every worker is away at the start"):
      hj.simulate(_loss, PARAMS, [_stream()], **options)
    return
  if kind == "refused":
    with pytest.raises(ValueError) as error:
      hj.simulate(_loss, PARAMS, [_stream()], **options)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{name}=") and "real clock" in message
    return
  result = hj.simulate(_loss, PARAMS, [_stream()], **options)
  assert result.summary["steps"] > 0
  if check is not None:
    assert check(result), result.summary
