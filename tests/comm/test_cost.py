"""The communication cost model (heloco_jax/comm/cost.py; ALGORITHMS.md, "Time and cost
model"): messages, ring all-reduces and DDP's overlap."""

import pytest

from heloco_jax.comm import cost


def test_communication_cost_model():
  free = cost.CommModel()
  assert free.message_seconds(1e9) == 0.0 and free.allreduce_seconds(1e9, 8) == 0.0
  comm = cost.CommModel(latency=0.01, bandwidth=1e6)
  assert comm.message_seconds(2e6) == pytest.approx(0.01 + 2.0)
  # Ring all-reduce: latency + 2(K−1)/K · B / bandwidth.
  assert comm.allreduce_seconds(4e6, 4) == pytest.approx(0.01 + 2 * 3 / 4 * 4.0)
  assert comm.allreduce_seconds(4e6, 1) == 0.0  # nothing to exchange
  with pytest.raises(ValueError, match="comm.latency=-1"):
    cost.CommModel(latency=-1)
  with pytest.raises(ValueError, match="comm.bandwidth=0"):
    cost.CommModel(bandwidth=0)


@pytest.mark.parametrize("overlap,compute,allreduce,expected", [
    (0.0, 1.0, 0.25, 1.25),     # no overlap: compute then the all-reduce
    (2 / 3, 1.0, 0.25, 1.0),    # hidden behind the backward pass
    (2 / 3, 1.0, 1.0, 1 + 1 / 3),  # only the part beyond 2/3 of the step shows
    (0.5, 2.0, 0.0, 2.0),
])
def test_ddp_overlap_hides_the_allreduce_behind_the_backward_pass(overlap, compute, allreduce,
                                                                   expected):
  comm = cost.CommModel(ddp_overlap=overlap)
  assert comm.ddp_step_seconds(compute, allreduce) == pytest.approx(expected)


@pytest.mark.parametrize("overlap", [-0.1, 1.0, float("nan")])
def test_ddp_overlap_outside_its_range_is_refused(overlap):
  with pytest.raises(ValueError, match="comm.ddp_overlap=.*allowed: a number in"):
    cost.CommModel(ddp_overlap=overlap)
