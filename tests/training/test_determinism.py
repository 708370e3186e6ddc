"""heloco_jax/training/determinism.py: XLA's deterministic GPU ops are set by the user or the CLI, never
by library code; a GPU backend without them fails in one line (docs/DESIGN.md, "Determinism")."""

import itertools
import os
import subprocess
import sys

import jax
import pytest

import heloco_jax as hj
from heloco_jax.training import determinism


@pytest.fixture
def no_flag(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
  assert not determinism.flag_set()


def test_configure_adds_the_flag_once_and_only_when_asked(no_flag):
  determinism.configure(False)
  assert not determinism.flag_set()
  determinism.configure(True)
  assert os.environ["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=1",
                                              determinism.FLAG]
  determinism.configure(True)  # once only
  assert os.environ["XLA_FLAGS"].count(determinism.FLAG) == 1


def test_require_never_writes_the_environment(no_flag, monkeypatch):
  # What make_engine / simulate call: a check, never an edit of XLA_FLAGS, on any backend.
  before = dict(os.environ)
  for platform in ("cpu", "tpu", "gpu"):
    monkeypatch.setattr(jax, "default_backend", lambda platform=platform: platform)
    try:
      determinism.require(True)
    except hj.DeterminismError:
      assert platform == "gpu"
  assert dict(os.environ) == before


def test_no_private_jax_import():
  source = open(determinism.__file__, encoding="utf-8").read()
  assert "jax._src" not in source


def test_a_gpu_backend_without_the_flag_fails_in_one_line(no_flag, monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  with pytest.raises(hj.DeterminismError) as error:
    determinism.require(True, "config.deterministic")
  message = str(error.value)
  assert "\n" not in message
  assert "config.deterministic=True needs XLA's deterministic GPU ops" in message
  assert "hj.enable_deterministic_ops()" in message
  assert "XLA_FLAGS=--xla_gpu_deterministic_ops=true" in message
  assert "config.deterministic=False" in message
  determinism.require(False)  # off: nothing to check


def test_cpu_and_tpu_programs_need_nothing(no_flag, monkeypatch):
  for platform in ("cpu", "tpu"):
    monkeypatch.setattr(jax, "default_backend", lambda platform=platform: platform)
    determinism.require(True)
  assert not determinism.flag_set()


@pytest.mark.parametrize("runtime, dtype, value, expected", [
    ("simulated", "float32", None, True),
    ("simulated", "bfloat16", None, False),  # 2.5x slower with the flag on an H200
    ("devices", "float32", None, False),     # a real clock: no replay anyway
    ("simulated", "bfloat16", True, True),
    ("simulated", "float32", False, False),
])
def test_the_cli_default_follows_the_runtime_and_the_compute_dtype(runtime, dtype, value,
                                                                   expected):
  from heloco_jax.cli.configs import default, validation  # pylint: disable=g-import-not-at-top
  config = default.get_config()
  config.runtime, config.model.compute_dtype, config.deterministic = runtime, dtype, value
  assert validation.deterministic(config) is expected
  from heloco_jax.lm import harness  # pylint: disable=g-import-not-at-top
  assert harness.deterministic(config) is expected


def test_a_bfloat16_run_on_a_gpu_says_it_will_not_replay(monkeypatch):
  from heloco_jax.cli import train  # pylint: disable=g-import-not-at-top
  from heloco_jax.cli.configs import default  # pylint: disable=g-import-not-at-top
  config = default.get_config()
  said = {}
  for platform, dtype, value in itertools.product(("cpu", "gpu"), ("float32", "bfloat16"),
                                                  (None, False)):
    monkeypatch.setattr(jax, "default_backend", lambda platform=platform: platform)
    config.model.compute_dtype, config.deterministic = dtype, value
    said[platform, dtype, value] = train._replay_off_by_default(config, simulated=True)
  # only where the default, not the user, left the flag off on a GPU
  assert [k for k, v in said.items() if v] == [("gpu", "bfloat16", None)]
  config.model.compute_dtype, config.deterministic = "bfloat16", None
  assert not train._replay_off_by_default(config, simulated=False)  # a real clock: no replay


@pytest.mark.slow  # 50–120 s: the default suite stays under 15 minutes
def test_the_cli_sets_the_flag_before_jax_starts(tmp_path):
  # In a fresh process the CLI's default (on, simulated runtime, float32) reaches XLA_FLAGS
  # before the backend starts; --config.deterministic=false and bfloat16 leave it out.
  script = ("import os, sys; from heloco_jax.cli import train; code = train.main(sys.argv[1:]); "
            "print(code, os.environ.get('XLA_FLAGS', ''))")
  tiny = ["--config.model.d_model=16", "--config.model.num_layers=1",
          "--config.model.context=8", "--config.batch_size=2", "--config.inner_steps=1",
          "--config.budget.tokens=64", "--config.num_workers=2",
          "--config.data.max_bytes_per_language=20000",
          "--config.data.val_sequences_per_language=2", "--config.checkpoint.every=0"]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  for name, extra, expected in (("unset", [], True),
                                ("false", ["--config.deterministic=false"], False),
                                ("bfloat16", ["--config.model.compute_dtype=bfloat16"], False)):
    out = subprocess.run([sys.executable, "-c", script, f"--workdir={tmp_path / name}", *tiny,
                          *extra], env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    code, _, flags = out.stdout.strip().partition(" ")
    assert code == "0", out.stderr[-2000:]
    assert (determinism.FLAG in flags) == expected
