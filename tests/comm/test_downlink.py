"""Compressed downloads (heloco_jax/comm/downlink.py; ALGORITHMS.md, "Compressed downloads")."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cnn
import heloco_jax as hj
import numpy_reference as ref
import tiny
from heloco_jax.comm import compress, downlink, fragments

PARAMS = tiny.regression_params()
INT8 = compress.int8()


def _run(workers=3, compressor=INT8, **kwargs):
  options = dict(method="heloco", inner_tx=optax.sgd(0.05), inner_steps=4,
                 budget=hj.Budget(steps=120), speeds=[1.0, 2.0, 3.0][:workers],
                 compress=hj.Compression(down=compressor),
                 comm=hj.CommModel(latency=0.25, bandwidth=4096.0))
  return hj.simulate(tiny.regression_loss, PARAMS,
                     [tiny.regression_stream(i) for i in range(workers)],
                     **{**options, **kwargs})


@pytest.mark.parametrize("kind", ["int8", "int4", "bf16", "top_k"])
def test_a_workers_starts_are_the_numpy_recursion_bit_for_bit(kind):
  """x̂ ← x̂ + D(C(θ_d − x̂)) over four dispatch points, against the float32 NumPy reference
  written from ALGORITHMS.md (the first start is θ_d itself)."""
  rng = np.random.default_rng(0)
  points = [[rng.normal(0, 1, (300,)).astype(np.float32) * (1 + t),
             rng.normal(0, 1, (7, 5)).astype(np.float32)] for t in range(4)]
  c = compress.by_name(kind, block=64, fraction=0.1)
  tree = lambda leaves: {"a": jnp.asarray(leaves[0]), "b": jnp.asarray(leaves[1])}
  link = downlink.Downlink(c, tree(points[0]))
  state = downlink.DownlinkState()
  state.start(tree(points[0]), 1)
  starts = [state.send(link, 0, lambda p=p: tree(p)) for p in points]
  expected = ref.download_starts(lambda x: ref.roundtrip(kind, x, block=64, fraction=0.1),
                                 points)
  for got, want in zip(starts, expected):
    for g, w in zip(jax.tree.leaves(got), want):
      np.testing.assert_array_equal(np.asarray(g), w)
  assert state.bytes_down == [link.message_bytes]
  assert link.model_bytes == 4 * (300 + 35)


def test_what_a_message_drops_goes_with_the_next_one():
  """The worker's start lags θ_d by one message's error only: sent again, the same point
  comes closer (error feedback without a residual of its own)."""
  point = {"w": jnp.linspace(-1.0, 1.0, 512)}
  link = downlink.Downlink(compress.int2(block=512), point)
  state = downlink.DownlinkState()
  state.start(jax.tree.map(jnp.zeros_like, point), 1)
  state.bytes_down = [1]  # it holds zeros: every dispatch sends a message
  errors = [float(jnp.max(jnp.abs(state.send(link, 0, lambda: point)["w"] - point["w"])))
            for _ in range(4)]
  assert all(a > b for a, b in zip(errors, errors[1:])), errors
  assert errors[-1] < 0.15 * errors[0], errors  # int2 halves it here at every message


def test_rows_and_the_clock_charge_theta_whole_first_and_the_message_after():
  result = _run()
  link = downlink.Downlink(INT8, PARAMS)
  assert link.message_bytes == 64 * 32 + 32 + 4 * (8 + 1)  # int8 codes + a scale per 256
  arrivals = [r for r in result.history if r["event"] == "arrival"]
  first, later = {}, []
  for r in arrivals:
    if r["worker"] in first:
      later.append(r["bytes_down"])
    else:
      first[r["worker"]] = r["bytes_down"]
  assert set(first.values()) == {link.model_bytes} and set(later) == {link.message_bytes}
  # Worker 0's first arrival: latency + θ's bytes down, 4 steps, latency + Δ's bytes up; its
  # second the same with the message's bytes down.
  up = 0.25 + link.model_bytes / 4096.0
  times = [r["sim_time"] for r in arrivals if r["worker"] == 0]
  assert times[0] == pytest.approx(0.25 + link.model_bytes / 4096.0 + 4.0 + up)
  assert times[1] - times[0] == pytest.approx(0.25 + link.message_bytes / 4096.0 + 4.0 + up)
  # Δ goes up as it is (no compress=): θ's bytes up, θ's bytes down at 3 first dispatches.
  n = len(arrivals)
  assert result.summary["bytes_sent"] == (n + 3) * link.model_bytes + (n - 3) * link.message_bytes
  assert _run(compressor=None).summary["bytes_sent"] == 2 * n * link.model_bytes


def test_a_run_with_compressed_downloads_learns_and_replays_bit_for_bit():
  first, again = _run(), _run()
  for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(again.params)):
    np.testing.assert_array_equal(a, b)
  losses = [r["train_loss"] for r in first.history if r["event"] == "arrival"]
  assert np.mean(losses[-6:]) < 0.5 * np.mean(losses[:6]), losses
  plain = _run(compressor=None)
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(first.params),
                                                       jax.tree.leaves(plain.params)))


FRAGMENTS = hj.Streaming(fragments=2, overlap_steps=1)


@pytest.mark.parametrize("streaming", [None, FRAGMENTS], ids=["whole", "fragments"])
def test_a_stopped_run_resumes_to_the_uninterrupted_one_bit_for_bit(tmp_path, streaming):
  """x̂ of every worker is checkpointed ("downlink" arrays; with fragments, the anchors) with
  the bytes of its latest download; a run stopped after 9 arrivals and resumed by the same
  call ends as one run."""
  # Re-iterable data: a resume reads it again from the start.
  batches = [[b for b, _ in zip(tiny.regression_stream(i), range(200))] for i in range(3)]
  options = dict(method="heloco", inner_tx=optax.sgd(0.05), inner_steps=4,
                 budget=hj.Budget(steps=120), speeds=[1.0, 2.0, 3.0],
                 compress=hj.Compression(down=INT8), streaming=streaming)
  uninterrupted = hj.simulate(tiny.regression_loss, PARAMS, batches, **options)
  options["workdir"] = hj.Workdir(str(tmp_path), checkpoint_every=4)

  def stop(row):
    if row["event"] == "arrival" and row["outer_updates"] == 9:
      raise KeyboardInterrupt
  with pytest.raises(KeyboardInterrupt):
    hj.simulate(tiny.regression_loss, PARAMS, batches, on_row=stop, **options)
  resumed = hj.simulate(tiny.regression_loss, PARAMS, batches, **options)
  for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(uninterrupted.params)):
    np.testing.assert_array_equal(a, b)
  assert resumed.summary["bytes_sent"] == uninterrupted.summary["bytes_sent"]


@pytest.mark.parametrize("streaming", [None, FRAGMENTS], ids=["whole", "fragments"])
def test_one_worker_on_the_devices_runtime_equals_the_simulated_runtime_bit_for_bit(streaming):
  # The default paces and a free link: a real clock refuses simulated paces and would wait
  # the link's seconds in real time (one worker's θ does not depend on either).
  on_devices = _run(workers=1, runtime=hj.devices_runtime(batch_size=8), streaming=streaming,
                    speeds="mixed", comm=hj.CommModel())
  simulated = _run(workers=1, streaming=streaming)
  assert on_devices.summary["outer_updates"] == simulated.summary["outer_updates"] > 20
  for a, b in zip(jax.tree.leaves(on_devices.params), jax.tree.leaves(simulated.params)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="diloco"), "compress=hj.Compression(down=...) is not allowed with "
                            "method='diloco'; allowed: the asynchronous methods"),
    (dict(compressor="int8"), "compress=Compression(up=None, down='int8') is not allowed; "
                              "allowed: None"),
])
def test_where_downloads_cannot_be_compressed_the_run_is_refused_in_one_line(kwargs, message):
  compressor = kwargs.pop("compressor", INT8)
  with pytest.raises(ValueError) as error:
    _run(compressor=compressor, **kwargs)
  assert message in str(error.value) and "\n" not in str(error.value)


def test_a_flax_cnn_with_batchnorm_dropout_and_metrics_trains_on_compressed_downloads():
  """The model a researcher brings (tests/cnn.py: flax.nnx Conv, BatchNorm, Dropout, accuracy
  in ``aux``) with int8 downloads: it learns, its statistics move, its metrics reach the rows,
  a replay is bit for bit, and its starts are not θ's (the params differ from a plain run)."""
  def run(compressor=INT8):
    return hj.simulate(cnn.cnn_loss, cnn.PARAMS, cnn.cnn_data(), method="heloco", inner_steps=4,
                       speeds=[1.0, 2.0], budget=hj.Budget(steps=96, eval_every_steps=48),
                       inner_tx=optax.adam(1e-2), eval_fn=cnn.cnn_eval, model_state=cnn.STATS,
                       method_options={"learning_rate": 0.7},
                       compress=hj.Compression(down=compressor))
  first = run()
  evals = [row for row in first.history if row["event"] == "eval"]
  assert evals[-1]["accuracy"] > evals[0]["accuracy"] + 0.2, evals
  arrivals = [row for row in first.history if row["event"] == "arrival"]
  assert all(0 <= row["train_accuracy"] <= 1 for row in arrivals)
  firsts = [next(i for i, row in enumerate(arrivals) if row["worker"] == w) for w in (0, 1)]
  later = {row["bytes_down"] for i, row in enumerate(arrivals) if i not in firsts}
  assert later == {downlink.Downlink(INT8, cnn.PARAMS).message_bytes}
  assert np.abs(first.model_state["bn"]["mean"].get_value()).max() > 0.1
  assert run().history == first.history
  plain = run(None)
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(first.params),
                                                       jax.tree.leaves(plain.params)))


def test_fragments_download_each_fragments_message_against_the_anchor():
  """With 2 fragments a worker's x̂ of fragment p is its anchor of p (what it last received of
  p): a first dispatch sends θ whole, each later one the message of the fragment it receives.
  The rows charge those bytes, fewer in all than without, and the run learns (replay, resume
  and runtime="devices" bit for bit: the tests above, with fragments)."""
  streaming = FRAGMENTS
  result = _run(streaming=streaming)
  link = downlink.Downlink(INT8, PARAMS, fragments.split(PARAMS, 2, streaming.layout))
  assert link.fragment_bytes == [32 + 4, 64 * 32 + 8 * 4]  # v, then w (θ's leaf order)
  arrivals = [r for r in result.history if r["event"] == "arrival"]
  firsts = [next(i for i, r in enumerate(arrivals) if r["worker"] == w) for w in range(3)]
  assert {arrivals[i]["bytes_down"] for i in firsts} == {link.model_bytes}
  later = [r for i, r in enumerate(arrivals) if i not in firsts]
  # A worker's second arrival received nothing yet (it sent fragment 1 after θ whole); every
  # later one received the fragment it sent before: that fragment's message.
  assert {r["bytes_down"] for r in later} <= {link.model_bytes, *link.fragment_bytes}
  assert set(link.fragment_bytes) <= {r["bytes_down"] for r in later}
  losses = [r["train_loss"] for r in arrivals]
  assert np.mean(losses[-6:]) < 0.5 * np.mean(losses[:6]), losses
  plain = _run(compressor=None, streaming=streaming)
  assert result.summary["bytes_sent"] < plain.summary["bytes_sent"]
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(result.params),
                                                       jax.tree.leaves(plain.params)))
