"""Time (heloco_jax/runtime/clocks.py, simulated.py): presets, jitter, DyLU and the simulated clock
(ALGORITHMS.md, "Time and cost model")."""

import types

import numpy as np
import pytest

from heloco_jax.comm import cost
from heloco_jax.runtime import base, clocks, simulated


@pytest.mark.parametrize("name, want", [
    ("homogeneous", [1, 1, 1, 1, 1]), ("mild", [1, 1, 1, 2, 2]), ("moderate", [1, 6, 6, 6, 6]),
    ("severe", [1, 15, 15, 15, 15]), ("mixed", [1, 2, 3, 1, 5]),
])
def test_presets_are_the_authors_values(name, want):
  np.testing.assert_array_equal(clocks.seconds_per_step(name, 5), want)


def test_presets_cycle_past_five_workers_and_lists_pass_through():
  sixteen = clocks.seconds_per_step("severe", 16)
  assert sixteen.shape == (16,) and list(sixteen[:7]) == [1, 15, 15, 15, 15, 1, 15]
  assert (sixteen == 1).sum() == 4  # workers 0, 5, 10, 15
  np.testing.assert_array_equal(clocks.seconds_per_step([0.5, 2, 3], 3), [0.5, 2.0, 3.0])


@pytest.mark.parametrize("speeds, workers, named", [
    ("turbo", 5, "speeds='turbo'"),
    ([1, 2], 3, "speeds=[1, 2]"),
    ([1, -2, 3], 3, "speeds=[1, -2, 3]"),
    ([1, float("nan")], 2, "speeds=[1, nan]"),
    (["fast", 1], 2, "speeds=['fast', 1]"),
    ("severe", 0, "num_workers=0"),
])
def test_invalid_speeds(speeds, workers, named):
  with pytest.raises(ValueError, match="allowed:") as error:
    clocks.seconds_per_step(speeds, workers)
  assert named in str(error.value)


def test_step_clock_without_jitter_is_exact():
  steps = simulated.StepClock(clocks.seconds_per_step("moderate", 5))
  assert steps.duration(0, 20) == 20.0 and steps.duration(3, 20) == 120.0


def test_step_clock_jitter_is_bounded_seeded_and_per_worker():
  seconds = clocks.seconds_per_step("mild", 5)
  a = simulated.StepClock(seconds, jitter=0.2, seed=3)
  durations = [a.duration(4, 10) for _ in range(200)]
  assert all(10 * 2 * 0.8 <= d <= 10 * 2 * 1.2 for d in durations)
  assert abs(np.mean(durations) - 20.0) < 0.2  # mean t_i·H; sd of the mean ≈ 0.05
  assert len(set(durations)) == 200
  # Same seed, same durations; worker 4's stream ignores calls for other workers.
  b = simulated.StepClock(seconds, jitter=0.2, seed=3)
  b.duration(0, 50)
  assert [b.duration(4, 10) for _ in range(200)] == durations
  assert simulated.StepClock(seconds, jitter=0.2, seed=4).duration(4, 10) != durations[0]


def test_step_clock_state_round_trips():
  seconds = clocks.seconds_per_step("mixed", 5)
  a = simulated.StepClock(seconds, jitter=0.1, seed=0)
  a.duration(2, 7)
  state = a.get_state()
  expected = [a.duration(w, 5) for w in range(5)]
  b = simulated.StepClock(seconds, jitter=0.1, seed=99)
  b.set_state(state)
  assert [b.duration(w, 5) for w in range(5)] == expected
  with pytest.raises(ValueError, match="jitter=1.0"):
    simulated.StepClock(seconds, jitter=1.0)


@pytest.mark.parametrize("speeds, want", [
    ("homogeneous", [20, 20, 20, 20, 20]),
    ("mild", [20, 20, 20, 10, 10]),
    ("moderate", [20, 3, 3, 3, 3]),      # ⌊20/6⌋
    ("severe", [20, 1, 1, 1, 1]),        # ⌊20/15⌋
    ("mixed", [20, 10, 6, 20, 4]),
])
def test_dylu_steps(speeds, want):
  np.testing.assert_array_equal(clocks.dylu_steps(clocks.seconds_per_step(speeds, 5), 20), want)


def test_dylu_floor_is_exact_and_at_least_one():
  # (1/2.6)/(1/0.2)·39 is 3 exactly, but floating point computes 2.9999999999999996.
  seconds = np.array([0.2, 2.6])
  assert (1 / seconds)[1] / (1 / seconds)[0] * 39 < 3
  np.testing.assert_array_equal(clocks.dylu_steps(seconds, 39), [39, 3])
  np.testing.assert_array_equal(clocks.dylu_steps(np.array([1.0, 1000.0]), 5), [5, 1])


def test_a_real_clock_plans_ddp_steps_from_the_fastest_step_timed(monkeypatch):
  """FAILURES.md: on a real clock with a schedule, DDP's chunk is cut by the fastest step
  timed so far; the first planned step also holds the seconds since the chunk's start."""
  now = [0.0]
  monkeypatch.setattr(clocks.time, "perf_counter", lambda: now[0])
  free_link = base.ClockSettings(np.ones(2), 0.0, 0, cost.CommModel(), model_bytes=8)
  clock = clocks.RealClock(free_link, types.SimpleNamespace(agree=lambda t: t))
  present = np.ones(2, bool)
  assert clock.plan_ddp(4, 0.0, 0, None) == (4, None)  # no schedule: nothing to cut
  assert clock.plan_ddp(4, 0.0, 0, present) == (4, None)  # no step timed yet
  now[0] = 2.0  # the 4 steps, with their compilation
  assert clock.ddp_seconds(None, 0.0, {}) == 2.0
  now[0] = 2.5  # (an evaluation)
  assert clock.plan_ddp(4, 2.0, 0, present) == (4, [(1.0, None)] + [(0.5, None)] * 3)
  now[0] = 3.0  # the chunk as the loop cut it: 2 steps in 0.5 s
  assert clock.ddp_seconds([(1.0, None), (0.5, None)], 2.0, {}) == 1.0
  assert clock.plan_ddp(2, 3.0, 0, present) == (2, [(0.25, None)] * 2)
  now[0] = 4.0  # a step nobody computed (params None) times nothing
  clock.ddp_seconds([(0.25, None)], 3.0, None)
  assert clock.plan_ddp(1, 4.0, 0, present) == (1, [(0.25, None)])
  assert clock.plan_ddp(1, 4.0, 4.0, present) == (0, None)  # the time budget is spent
