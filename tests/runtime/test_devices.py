"""runtime=devices (heloco_jax/runtime/devices.py): device groups, and whole runs on 8 host devices."""

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import types

import jax
import numpy as np
import optax
import pytest
import tiny

import heloco_jax as hj

from heloco_jax.cli.configs import validation
from heloco_jax.comm import syncer
from heloco_jax.runtime import base, devices
from heloco_jax.runtime.base import Job

# One worker process runs this module, so the 8-device probe (a minute) runs once.
pytestmark = pytest.mark.xdist_group("devices_probe")

FAKE = [f"dev{i}" for i in range(8)]  # group_devices only slices the list


def test_groups_split_the_devices_evenly_by_default_and_follow_explicit_sizes():
  groups = devices.group_devices(4, batch_size=4, devices=FAKE)
  assert groups.groups == (("dev0", "dev1"), ("dev2", "dev3"), ("dev4", "dev5"),
                           ("dev6", "dev7"))
  assert groups.server == "dev0" and groups.slowdown == (1.0,) * 4
  groups = devices.group_devices(3, batch_size=4, group_sizes="1,2,4", server=7,
                                 slowdown="1,2.5,1", devices=FAKE)
  assert groups.groups == (("dev0",), ("dev1", "dev2"), ("dev3", "dev4", "dev5", "dev6"))
  assert groups.server == "dev7" and groups.slowdown == (1.0, 2.5, 1.0)
  assert devices.group_devices(3, 4, devices=FAKE).groups[2] == ("dev4", "dev5")  # 2 unused


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_workers=9), "needs a device per worker: num_workers=9 but this process has 8"),
    (dict(group_sizes="4,4,2"), "group_sizes='4,4,2' is not allowed; allowed: sizes ≥ 1 "
                                "adding up to at most the 8 device"),
    (dict(group_sizes="2,2"), "one number per worker (3), got 2"),
    (dict(group_sizes="a,b,c"), "3 comma-separated numbers, one per worker"),
    (dict(group_sizes="1,1,3"), "batch_size=4 is not allowed with devices.group_sizes [1, 1, 3]"),
    (dict(server=8), "devices.server=8 is not allowed; allowed: 0 to 7"),
    (dict(slowdown="1,0.5,1"), "slowdown='1,0.5,1' is not allowed; allowed: factors ≥ 1"),
    (dict(group_sizes="1,1,2", synchronous=True),
     "group_sizes=[1, 1, 2] is not allowed for a synchronous method; allowed: equal group"),
])
def test_bad_device_settings_fail_with_one_clear_line(kwargs, message):
  args = {**dict(num_workers=3, batch_size=4, devices=FAKE), **kwargs}
  with pytest.raises(devices.DeviceConfigError) as error:
    devices.group_devices(**args)
  assert message in str(error.value)


def test_config_validation_checks_the_devices_of_this_process():
  # This process has one CPU device, so 3 workers cannot each own one.
  with pytest.raises(validation.ConfigError, match="needs a device per worker: num_workers=3 "
                     "but this process has 1 device"):
    validation.validate(tiny.config("heloco", 3, runtime="devices", **{"budget.tokens": 100}))
  if jax.device_count() == 1:
    validation.validate(tiny.config("heloco", 1, runtime="devices", **{"budget.tokens": 100}))
  with pytest.raises(validation.ConfigError, match="config.runtime='tpu' is not allowed; "
                                                   "allowed: one of: simulated, devices, ray"):
    validation.validate(tiny.config("heloco", 1, runtime="tpu", **{"budget.tokens": 100}))


class _SlowResult:
  """A Δ whose computation takes 0.5 s (``jax.block_until_ready`` calls this)."""

  def block_until_ready(self):
    time.sleep(0.5)
    return self


def test_closing_the_arrivals_waits_for_the_threads_that_wait_on_dropped_work():
  # A budget ends with a worker in flight: close() drops it. Its waiting thread must be done
  # before the event loop closes; finishing later, it would call into the closed loop.
  arrivals = devices.DeviceArrivals(time.perf_counter, [1.0])

  async def run():
    arrivals.push(0, types.SimpleNamespace(delta=_SlowResult()))
    await asyncio.sleep(0.1)  # its thread is waiting now
    arrivals.close()
  asyncio.run(run())
  assert not [t for t in threading.enumerate() if t.name.startswith("heloco-arrivals")]


class _TimedArrivals(devices.DeviceArrivals):
  """A real queue whose job ``j`` is ready ``j.delta`` seconds after it is pushed."""

  async def _ready(self, worker, job):
    del worker
    await asyncio.sleep(job.delta)


def test_the_real_queue_takes_a_leaving_workers_job_then_and_keeps_events_out_of_groups():
  """FAILURES.md: a job whose worker leaves before it is ready is taken at the leave; a
  membership event due first is taken alone; one that comes due while a quorum waits is
  handled at its time, never grouped."""
  start = time.perf_counter()
  arrivals = _TimedArrivals(lambda: time.perf_counter() - start, [1.0] * 4)
  away, handled = {2, 3}, []
  events = base.Events(lambda w: w in away, lambda w: False,
                       lambda w, at: (away.discard(w), handled.append((w, at))))

  async def run():
    arrivals.push(0, Job(0.2, 0, 1, 0.0))
    arrivals.push(1, Job(5.0, 0, 1, 0.0), leaves=0.8)  # it leaves before it is ready
    arrivals.push(2, Job(None, 0, 0, 0.1))  # membership events at 0.1 and 0.5
    arrivals.push(3, Job(None, 0, 0, 0.5))
    first = await arrivals.pop(syncer.GroupRule(quorum=2), events)
    group = await arrivals.pop(syncer.GroupRule(quorum=2), events)
    arrivals.close()
    return first, group
  (at, alone, _), (_, group, times) = asyncio.run(run())
  assert at == 0.1 and alone == [2]  # due first: alone
  assert handled == [(3, 0.5)]  # due while the group waited for its quorum
  assert group == [0, 1] and 0.2 <= times[0] < 0.5 and times[1] == 0.8  # 1 taken at its leave


def _probe(tmp_path_factory, *flags):
  out = tmp_path_factory.mktemp("devices") / "probe.json"
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  subprocess.run([sys.executable, os.path.join(root, "tests", "devices_probe.py"), str(out),
                  *flags], check=True, timeout=900, cwd=root)
  with open(out) as f:
    return json.load(f)


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
  """tests/devices_probe.py's runs on 8 host CPU devices (one subprocess, ~2 min)."""
  return _probe(tmp_path_factory)


@pytest.fixture(scope="module")
def slow_probe(tmp_path_factory):
  """tests/devices_probe.py's runs for ``-m slow`` (one subprocess, ~3 min)."""
  return _probe(tmp_path_factory, "--slow")


def _arrivals(run):
  return [r for r in run["rows"] if r["event"] == "arrival"]


def test_async_heloco_on_device_groups_learns(probe):
  """θ in 2 fragments, int8 + error feedback: ALGORITHMS.md, "Fragments" and "Compression in
  a run" (a worker sends fragment 1 first, then 0, 1, ...)."""
  assert probe["num_devices"] == 8
  summary = probe["heloco"]["summary"]
  assert summary["final_val_loss"] < summary["initial_val_loss"] - 1.0
  assert summary["tokens"] <= 6_000
  assert probe["heloco"]["param_devices"] == [7]  # the chosen server device


def _check_arrival_log(run, expected):
  arrivals = _arrivals(run)
  assert [a["outer_updates"] for a in arrivals] == list(range(1, len(arrivals) + 1))
  times = [a["sim_time"] for a in arrivals]
  assert times == sorted(times) and times[0] > 0  # real completion order, real seconds
  # A worker's Δ of fragment p arrives with τ = (p's updates before it) − p's version when the
  # worker last received p: all of θ at its first dispatch, then the fragment it had sent.
  fragments = 1 + max(a["fragment"] for a in arrivals)
  versions, received = [0] * fragments, {w: [0] * fragments for w in range(4)}
  for a in arrivals:
    p = a["fragment"]
    assert a["staleness"] == versions[p] - received[a["worker"]][p]
    versions[p] += 1
    received[a["worker"]][p] = versions[p]
  assert expected <= {a["worker"] for a in arrivals}


def test_arrival_log_is_consistent(probe):
  _check_arrival_log(probe["heloco"], {0, 1, 2})  # worker 3 is slowed


@pytest.mark.slow  # the default suite stays under 15 minutes
def test_arrival_log_of_unequal_groups_is_consistent(slow_probe):
  _check_arrival_log(slow_probe["mla_unequal"], {0, 1, 2, 3})


def test_a_slowed_worker_arrives_less_often(probe):
  counts = np.bincount([a["worker"] for a in _arrivals(probe["heloco"])], minlength=4)
  assert counts[3] < counts[0], counts


def _eval_losses(run):
  return [r["val_loss"] for r in run["rows"] if r["event"] == "eval"]


def _relative_difference(params, reference):
  a, b = (np.concatenate([np.ravel(x) for x in tree]) for tree in (params, reference))
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.slow  # the default suite stays under 15 minutes
def test_sync_diloco_on_the_workers_mesh_equals_the_simulated_runtime(slow_probe):
  """Equal within float tolerance: XLA partitions the vmapped program over the workers axis
  (and, with two devices per worker, splits each batch), which reorders float sums; Adam
  amplifies those ulps over the rounds to ~0.3% of ‖θ‖ here. An unrelated run of the same
  model (compressed Streaming DiLoCo) differs by far more."""
  simulated = slow_probe["diloco_simulated"]
  for name in ("diloco_devices", "diloco_devices_split"):
    summary = slow_probe[name]["summary"]
    assert summary["outer_updates"] == simulated["summary"]["outer_updates"] > 0
    assert summary["tokens"] == simulated["summary"]["tokens"]
    assert _relative_difference(slow_probe[name]["params"], simulated["params"]) < 0.02
    np.testing.assert_allclose(_eval_losses(slow_probe[name]), _eval_losses(simulated),
                               rtol=2e-3)
  unrelated = slow_probe["diloco_fragments_simulated"]["params"]
  assert _relative_difference(unrelated, simulated["params"]) > 0.1


def test_elastic_rounds_on_device_groups_leave_out_the_absent_worker(probe):
  """A failure schedule on the real clock (FAILURES.md): worker 1 away from the start, for
  good, takes part in no round: every round's tokens are three workers' parts, none dropped."""
  run = probe["diloco_elastic_devices"]
  summary, per_round = run["summary"], 3 * tiny.H * tiny.BATCH * tiny.CONTEXT  # 3 workers' parts
  trains = [r for r in run["rows"] if r["event"] == "train"]
  assert [r["tokens"] for r in trains] == [per_round * (i + 1) for i in range(len(trains))]
  assert summary["dispatched_tokens"] == summary["tokens"] and summary["dropped_tokens"] == 0
  assert not [r for r in run["rows"] if r["event"] in ("left", "joined")]
  assert summary["final_val_loss"] < summary["initial_val_loss"] - 1.0


@pytest.mark.slow  # the default suite stays under 15 minutes
def test_elastic_rounds_on_device_groups_equal_the_simulated_runtime(probe, slow_probe):
  """The same schedule's rounds on the simulated runtime: equal within the float tolerance of
  the unscheduled pair (``test_sync_diloco_on_the_workers_mesh_equals_the_simulated_runtime``)."""
  devices, simulated = probe["diloco_elastic_devices"], slow_probe["diloco_elastic_simulated"]
  assert devices["summary"]["tokens"] == simulated["summary"]["tokens"]
  assert devices["summary"]["outer_updates"] == simulated["summary"]["outer_updates"] > 0
  assert _relative_difference(devices["params"], simulated["params"]) < 0.02
  np.testing.assert_allclose(_eval_losses(devices), _eval_losses(simulated), rtol=2e-3)


def test_fragments_and_compression_run_on_device_groups(probe):
  """Issue 58: the devices runtime carries hj.Streaming and int8 + error feedback: async
  HeLoCo's compressed fragment arrivals on 4 device groups (learning: the test above); the two
  fragments' payloads together are a quarter of θ's float32 bytes plus the scales."""
  arrivals = _arrivals(probe["heloco"])
  assert {a["fragment"] for a in arrivals} == {0, 1}
  up = {a["fragment"]: a["bytes_up"] for a in arrivals}
  theta = max(a["bytes_down"] for a in arrivals)  # a first dispatch sends θ whole
  assert theta / 4 < up[0] + up[1] < theta / 3.5  # int8 codes and a float32 scale per 256


@pytest.mark.slow  # the default suite stays under 15 minutes
def test_compressed_streaming_rounds_on_device_groups_equal_the_simulated_runtime(slow_probe):
  """Compressed Streaming DiLoCo's rounds (τ = 1), each worker's residual on its device."""
  simulated = slow_probe["diloco_fragments_simulated"]
  devices = slow_probe["diloco_fragments_devices"]
  assert devices["summary"]["bytes_sent"] == simulated["summary"]["bytes_sent"]
  assert devices["summary"]["outer_updates"] == simulated["summary"]["outer_updates"]
  assert _relative_difference(devices["params"], simulated["params"]) < 0.02
  np.testing.assert_allclose(_eval_losses(devices), _eval_losses(simulated), rtol=2e-3)


@pytest.mark.parametrize("outer_layout", ["tree", "packed"])
def test_compressed_fragments_on_the_devices_runtime_equal_the_simulated_runtime_bit_for_bit(
    outer_layout):
  """One worker in this process (one device): the devices runtime's split compression
  (``compress.send`` on the worker's devices, ``receive`` of the message alone on the
  server's) and its fragment dispatches = the simulated runtime's one program (``transmit``),
  bit for bit, with the server's θ as a tree or packed (docs/ALGORITHMS.md, "Packed outer
  state"); the 8-device TinyGPT twin is ``-m slow`` (``slow_probe``)."""
  params = tiny.regression_params()
  options = dict(method="heloco", inner_tx=optax.sgd(0.05), inner_steps=4,
                 budget=hj.Budget(steps=40), streaming=hj.Streaming(fragments=2, overlap_steps=1),
                 compress=hj.compress.error_feedback(hj.compress.int8()))
  on_devices = hj.simulate(tiny.regression_loss, params, [tiny.regression_stream(0)],
                           runtime=hj.devices_runtime(batch_size=8, outer_layout=outer_layout),
                           **options)
  simulated = hj.simulate(tiny.regression_loss, params, [tiny.regression_stream(0)],
                          runtime=hj.simulated_runtime(outer_layout=outer_layout), **options)
  assert on_devices.summary["outer_updates"] == simulated.summary["outer_updates"] == 20
  assert {r["fragment"] for r in on_devices.history if r["event"] == "arrival"} == {0, 1}
  for a, b in zip(jax.tree.leaves(on_devices.params), jax.tree.leaves(simulated.params)):
    np.testing.assert_array_equal(a, b)
  losses = [r["train_loss"] for r in on_devices.history if r["event"] == "arrival"]
  assert np.mean(losses[-4:]) < 0.5 * np.mean(losses[:4]), losses


@pytest.mark.slow  # the default suite stays under 15 minutes (in-process twin above)
def test_compressed_payload_across_devices_equals_the_simulated_runtime_bit_for_bit(slow_probe):
  """One worker: compressed on its device, the payload moved, decompressed on the server's
  (``compress.send``/``receive``) = the simulated runtime's one program (``transmit``)."""
  simulated, devices = slow_probe["heloco_one_simulated"], slow_probe["heloco_one_devices"]
  assert devices["summary"]["outer_updates"] == simulated["summary"]["outer_updates"] > 2
  assert devices["params"] == simulated["params"]
  assert _eval_losses(devices) == _eval_losses(simulated)


def test_the_link_model_is_waited_on_the_real_clock_and_reported():
  """Issue 77: ``comm=hj.CommModel(latency, bandwidth)`` on ``runtime=devices`` (before: ignored
  without a word). One worker, 6 arrivals: each waits its download and its upload, latency +
  bytes/bandwidth each, in real time; the summary's ``network_seconds`` is what the link
  charged, as on the simulated clock, and the free default waits nothing."""
  def loss(params, batch):
    return jax.numpy.mean((batch @ params["w"] - 1.0) ** 2)

  def stream():
    rng = np.random.default_rng(0)
    while True:
      yield rng.normal(0, 1, (4, 8)).astype(np.float32)

  params = {"w": np.zeros((8, 1), np.float32)}  # 32 bytes
  common = dict(method="heloco", inner_tx=optax.sgd(0.05), inner_steps=2,
                budget=hj.Budget(steps=12), runtime=hj.devices_runtime(batch_size=4))
  free = hj.simulate(loss, params, [stream()], **common)
  comm = hj.CommModel(latency=0.25, bandwidth=32 / 0.05)  # 0.3 s a message
  linked = hj.simulate(loss, params, [stream()], comm=comm, **common)
  simulated = hj.simulate(loss, params, [stream()], comm=comm, **{**common, "runtime": None})
  assert free.summary["network_seconds"] == 0.0
  assert linked.summary["outer_updates"] == 6
  assert linked.summary["network_seconds"] == pytest.approx(6 * 2 * 0.3)
  assert linked.summary["network_seconds"] == pytest.approx(simulated.summary["network_seconds"])
  # One worker waits its messages one after another, so at least what the link charged passes on
  # the real clock (3.6 s; the run's compute alone is under 1 s). A margin over the free run's
  # time flaked under CI load (stop 89: its compute took 0.70 s, the linked run's 0.33 s).
  assert linked.summary["sim_time"] >= linked.summary["network_seconds"] - 0.01
