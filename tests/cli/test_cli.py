"""The heloco-jax console script: usage, config errors, a full run and its files."""

import io
import json
import pathlib
import re
import subprocess
import sys

import pytest

from heloco_jax.cli import main as cli
from heloco_jax.cli import train

TINY = ["--config.num_workers=3", "--config.model.d_model=32", "--config.model.num_layers=1",
        "--config.model.context=16", "--config.batch_size=4", "--config.inner_steps=2",
        "--config.data.max_bytes_per_language=40000", "--config.data.val_sequences_per_language=8",
        "--config.speeds=homogeneous", "--config.budget.eval_every_tokens=512"]


def test_train_without_workdir_fails_with_usage(capsys):
  assert cli.main(["train"]) == 2
  assert "--workdir is required" in capsys.readouterr().err


def test_unknown_command_lists_the_allowed_ones(capsys):
  assert cli.main(["fly"]) == 2
  assert "unknown command 'fly'; allowed: train, corpus, plot" in capsys.readouterr().err


def test_train_help_lists_the_config_keys_with_defaults_and_allowed_values(capsys):
  assert cli.main(["train", "--help"]) == 0
  out = capsys.readouterr().out
  assert "--workdir" in out and "outer.keep_threshold" in out and "0.2" in out
  assert "delayed_nesterov" in out and "budget.tokens" in out


def test_help_exits_zero(capsys):
  assert cli.main(["--help"]) == 0
  assert "heloco-jax train --workdir=DIR" in capsys.readouterr().out


# Every config key of DESIGN.md with a bad value: one line naming key, value, what is allowed.
_BAD = [
    ("method=adam", "config.method='adam'"),
    ("seed=-1", "config.seed=-1"),
    ("num_workers=0", "config.num_workers=0"),
    ("inner_steps=0", "config.inner_steps=0"),
    ("speeds=turbo", "config.speeds='turbo'"),
    ("speeds=[1,2]", "config.speeds=[1, 2]"),
    ("data.source=web", "config.data.source='web'"),
    ("data.partition=random", "config.data.partition='random'"),
    ("data.dirichlet_alpha=0", "config.data.dirichlet_alpha=0"),
    ("data.source=text_dir", "config.data.path=''"),
    ("budget.tokens=-5", "config.budget.tokens=-5"),
    ("budget.sim_seconds=-1", "config.budget.sim_seconds=-1"),
    ("budget.eval_every_tokens=-1", "config.budget.eval_every_tokens=-1"),
    ("runtime=cloud", "config.runtime='cloud'"),
    ("checkpoint.every=-1", "config.checkpoint.every=-1"),
    ("batch_size=0", "config.batch_size=0"),
    ("model.d_model=0", "config.model.d_model=0"),
    ("model.num_layers=0", "config.model.num_layers=0"),
    ("model.num_heads=3", "config.model.num_heads=3"),
    ("model.context=0", "config.model.context=0"),
    ("jitter=1.5", "config.jitter=1.5"),
    ("syncer.grace_window=-1", "config.syncer.grace_window=-1"),
    ("lookahead_dispatch=false", "config.lookahead_dispatch=False"),
    ("outer.learning_rate=0", "config.outer.learning_rate=0.0"),
    ("seed=99999999999999999999", "config.seed=99999999999999999999"),
    ("inner.learning_rate=0", "config.inner.learning_rate=0"),
    ("inner.pseudo_sync_prob=1.0", "config.inner.pseudo_sync_prob=1.0"),
    ("outer.keep_threshold=1.5", "config.outer.keep_threshold=1.5"),
    ("outer.momentum=1.0", "config.outer.momentum=1.0"),
    ("outer.weighting=linear", "config.outer.weighting='linear'"),
    ("outer.scope=layer", "config.outer.scope='layer'"),
    ("comm.latency=-0.5", "config.comm.latency=-0.5"),
    ("metrics_fetch_every=0", "config.metrics_fetch_every=0"),
    ("rejection_limit=-1", "config.rejection_limit=-1"),
    ("rejection_limit=0", "config.rejection_limit=0"),
    ("palsgd_warmup_steps=-1", "config.palsgd_warmup_steps=-1"),
    ("compression.kind=int3", "config.compression.kind='int3'"),
    ("compression.block=0", "config.compression.block=0"),
    ("compression.fraction=0", "config.compression.fraction=0"),
    ("streaming.fragments=0", "config.streaming.fragments=0"),
    ("streaming.fragments=3", "config.streaming.fragments=3"),  # does not divide H = 20
    ("streaming.layout=random", "config.streaming.layout='random'"),
    ("streaming.alpha=0", "config.streaming.alpha=0"),
    ("streaming.overlap_steps=1", "config.streaming.overlap_steps=1"),  # with one fragment
]


def test_dylu_is_for_asynchronous_methods_only():
  # hj.make_engine takes it in an asynchronous method's method_options only; the CLI says so
  # rather than dropping it.
  from heloco_jax.cli.configs import default, validation
  config = default.get_config()
  config.dylu = True
  validation.validate(config)  # heloco
  config.method = "diloco"
  with pytest.raises(validation.ConfigError, match=r"^config\.dylu=True is not allowed; "
                                                   r"allowed: False with method='diloco'"):
    validation.validate(config)


def test_a_fresh_optimizer_per_dispatch_is_refused_for_ddp():
  """DDP has no dispatches: inner.reset_optimizer=True would be ignored, so it is refused;
  False (what DDP does) and unset are taken."""
  from heloco_jax.cli.configs import default, validation
  config = default.get_config()
  config.method, config.inner.reset_optimizer = "ddp", False
  validation.validate(config)
  config.inner.reset_optimizer = True
  with pytest.raises(validation.ConfigError, match=r"^config\.inner\.reset_optimizer=True is "
                                                   r"not allowed with method='ddp'; allowed: "
                                                   r"None or False"):
    validation.validate(config)
  config.method = "diloco"
  validation.validate(config)


def test_every_outer_key_is_some_methods_and_checked_for_the_others():
  from heloco_jax.cli.configs import schema, validation
  from heloco_jax.training import methods
  owned = set().union(*map(validation._keys_of, methods.METHODS.values()))  # pylint: disable=protected-access
  assert {k.name for k in schema.KEYS if k.name.startswith("outer.")} <= owned


@pytest.mark.parametrize("method, key, value, owners", [
    ("diloco", "outer.keep_threshold", 0.5, "heloco"),
    ("ddp", "outer.learning_rate", 0.5,
     "diloco, palsgd, async_nesterov, delayed_nesterov, mla, heloco, cgad"),
    ("heloco", "inner.pseudo_sync_prob", 0.3, "palsgd"),
    ("mla", "palsgd_warmup_steps", 5, "palsgd"),
    ("palsgd", "outer.weighting", "none", "async_nesterov, delayed_nesterov, mla, heloco"),
    ("cgad", "outer.buffer_size", 3, "delayed_nesterov"),
])
def test_another_methods_key_set_away_from_its_default_is_refused(method, key, value, owners):
  """It would be ignored (the CLI passes a method only its own keys): refused in one line
  naming the key and the methods that take it; the owner takes it."""
  from heloco_jax.cli.configs import default, validation
  config = default.get_config()
  config.method = method
  *parents, leaf = key.split(".")
  node = config
  for parent in parents:
    node = node[parent]
  node[leaf] = value
  with pytest.raises(validation.ConfigError) as error:
    validation.validate(config)
  assert str(error.value).startswith(f"config.{key}={value!r} is not allowed; allowed: ")
  assert f"with method={method!r} (a key of {owners})" in str(error.value)
  config.method = owners.split(", ")[-1]
  validation.validate(config)


def test_palsgds_pull_constraint_binds_palsgd_only():
  from heloco_jax.cli.configs import default, validation
  config = default.get_config()
  config.inner.learning_rate = 1e6  # a key heloco uses; pseudo_sync_rate it does not
  validation.validate(config)
  config.method = "palsgd"
  with pytest.raises(validation.ConfigError, match="config.inner.pseudo_sync_rate=0.5"):
    validation.validate(config)


@pytest.mark.parametrize("override, named", _BAD, ids=[b[0] for b in _BAD])
def test_every_invalid_config_value_fails_before_any_work(override, named, tmp_path, capsys):
  workdir = tmp_path / "run"
  assert cli.main(["train", f"--workdir={workdir}", f"--config.{override}"]) == 2
  err = capsys.readouterr().err
  assert named in err and "allowed:" in err, err
  assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
  assert not workdir.exists()  # nothing was written


def test_compression_where_it_cannot_run_fails_in_one_line(tmp_path, capsys):
  workdir = tmp_path / "run"
  assert cli.main(["train", f"--workdir={workdir}", "--config.compression.kind=int8",
                   "--config.method=ddp"]) == 2
  err = capsys.readouterr().err
  named = "config.compression.kind='int8' is not allowed; allowed: 'none' with method='ddp'"
  assert named in err and len(err.strip().splitlines()) == 1, err
  assert not workdir.exists()


def test_unknown_key_and_bad_type_are_one_line_errors(tmp_path, capsys):
  # no close match: the keys of its group; a near one: did you mean
  assert cli.main(["train", f"--workdir={tmp_path}", "--config.model.widht=3"]) == 2
  assert ("--config.model.widht names no config key; its group's keys: model.attention, "
          in capsys.readouterr().err)
  # a near miss (ml_collections then suggests a key in its message): named all the same
  assert cli.main(["train", f"--workdir={tmp_path}", "--config.seeds=1"]) == 2
  assert ("heloco-jax train: --config.seeds names no config key; did you mean --config.speeds, "
          "--config.seed?" in capsys.readouterr().err)
  assert cli.main(["train", f"--workdir={tmp_path}", "--config.outer.learning_rat=1"]) == 2
  err = capsys.readouterr().err
  assert "did you mean --config.outer.learning_rate, --config.inner.learning_rate?" in err
  assert "(every key: heloco-jax train --help)" in err and len(err.strip().splitlines()) <= 2
  assert cli.main(["train", f"--workdir={tmp_path}", "--config.num_workers=abc"]) == 2
  assert "invalid literal" in capsys.readouterr().err


def test_fault_injection_is_no_config_key(tmp_path, capsys):
  """Faults are injected by the tests' executor wrapper (tests/faults.py), not by the config."""
  assert cli.main(["train", f"--workdir={tmp_path}", "--config.fault.worker=1"]) == 2
  assert "--config.fault.worker names no config key" in capsys.readouterr().err
  assert not any(tmp_path.iterdir())


def test_a_run_writes_config_metrics_and_summary(tmp_path, capsys):
  workdir = tmp_path / "run"
  args = ["train", f"--workdir={workdir}", *TINY, "--config.method=diloco",
          "--config.budget.tokens=2048"]
  assert cli.main(args) == 0
  config = json.loads((workdir / "config.json").read_text())
  assert config["method"] == "diloco" and config["num_workers"] == 3
  assert config["config_schema"] == 1  # the layout's version, as the API's (issue 78)
  import jax  # pylint: disable=g-import-not-at-top
  from heloco_jax.runtime import simulated  # pylint: disable=g-import-not-at-top
  # "auto" as it ran (issue 79): "sequential" on CPU
  assert config["worker_batching"] == simulated.AUTO_BATCHING[jax.default_backend()]
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  evals = [r for r in rows if r["event"] == "eval"]
  assert evals[0]["tokens"] == 0 and evals[-1]["tokens"] == 5 * 384  # rounds of 3·2·4·16 ≤ 2048
  assert {"val_loss/syn0", "sim_time", "outer_updates"} <= set(evals[-1])
  summary = json.loads((workdir / "summary.json").read_text())
  assert set(summary) == {"method", "seed", "tokens", "applied_tokens", "rejected_tokens",
                          "rejected", "rejected_by", "sim_time", "outer_updates",
                          "initial_val_loss", "final_val_loss", "mean_staleness",
                          "bytes_sent", "peak_bytes_per_sync", "network_seconds",
                          "wall_seconds", "tokens_per_second", "num_params"}
  assert summary["final_val_loss"] < summary["initial_val_loss"]
  assert "done:" in capsys.readouterr().err
  # A second run into the same finished workdir is refused (resume comes with checkpoints).
  assert cli.main(args) == 2
  assert "already holds a finished run" in capsys.readouterr().err


def test_async_run_logs_arrival_rows_with_heloco_diagnostics(tmp_path):
  workdir = tmp_path / "run"
  assert cli.main(["train", f"--workdir={workdir}", *TINY, "--config.budget.tokens=1280"]) == 0
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  arrivals = [r for r in rows if r["event"] == "arrival"]
  assert len(arrivals) == 10
  assert {"worker", "staleness", "sim_time", "cosine_mean", "branch_count/shrink",
          "rotation_mean", "shrinkage_mean", "weight"} <= set(arrivals[-1])


def test_module_entry_point_matches_console_script(tmp_path):
  result = subprocess.run([sys.executable, "-m", "heloco_jax.cli.train", f"--workdir={tmp_path}",
                           "--config.num_workers=0"], capture_output=True, text=True,
                          check=False)
  assert result.returncode == 2 and "config.num_workers=0 is not allowed" in result.stderr


def test_compilation_cache_directory_fills_and_can_be_turned_off(tmp_path, monkeypatch):
  from heloco_jax.cli import train  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert train.default_cache_dir() == str(tmp_path / "xdg" / "heloco_jax" / "xla")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
  assert train.default_cache_dir() == str(tmp_path / "env")
  # A fresh process (the cache is set up once per process): one jitted call fills DIR.
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
  code = ("import sys, jax, jax.numpy as jnp; from heloco_jax.cli import train; "
          "train.use_compilation_cache(sys.argv[1]); jax.jit(lambda x: x * 2 + 1)(jnp.ones(3)); "
          "print(jax.config.jax_compilation_cache_dir)")
  for path, expected in [(str(tmp_path / "cache"), str(tmp_path / "cache")), ("", "None")]:
    out = subprocess.run([sys.executable, "-c", code, path], check=True, cwd=tmp_path,
                         capture_output=True, text=True).stdout
    assert out.strip() == expected
  assert any((tmp_path / "cache").iterdir())


def test_progress_lines_without_a_terminal_come_every_interval_and_at_each_evaluation():
  now = [0.0]
  out = io.StringIO()
  lines = train.ProgressLines(1000, 0.0, interval=30.0, clock=lambda: now[0], stream=out)
  lines.update(0, 0.0, 5.0, evaluated=True)        # the initial evaluation: a line
  now[0] = 10.0
  lines.update(100, 5.0, 5.0, evaluated=False)     # within 30 s: none
  now[0] = 40.0
  lines.update(400, 20.0, 5.0, evaluated=False)    # 30 s on: a line, printed at the next row
  now[0] = 41.0
  lines.update(450, 22.0, 5.0, evaluated=False)    # ... a later burst: printed now
  now[0] = 80.0
  lines.update(450, 22.0, 5.0, evaluated=False)    # due again, but in the burst of
  lines.update(500, 25.0, 4.2, evaluated=True)     # an evaluation: only its line
  printed = out.getvalue().splitlines()
  assert len(printed) == 3
  assert printed[1] == ("heloco-jax train: 400 tokens of 1,000 (40%), 20 s simulated, "
                        "val_loss 5.000, 10 tokens/s, about 1.0 min left")
  assert printed[2].startswith("heloco-jax train: 500 tokens of 1,000 (50%), 25 s simulated, "
                               "val_loss 4.200") and "about 1.3 min left" in printed[2]


def test_progress_lines_show_in_a_batch_job_unless_quiet(tmp_path):
  common = [sys.executable, "-m", "heloco_jax.cli.train", *TINY, "--config.budget.tokens=4096"]
  shown = subprocess.run([*common, f"--workdir={tmp_path / 'a'}"], capture_output=True,
                         text=True, check=True)
  assert re.search(r"train: [\d,]+ tokens of [\d,]+ \(\d+%\), .* val_loss \d", shown.stderr)
  quiet = subprocess.run([*common, f"--workdir={tmp_path / 'b'}", "--config.quiet=true"],
                         capture_output=True, text=True, check=True)
  assert "tokens of" not in quiet.stderr and "done:" in quiet.stderr


@pytest.mark.slow
def test_the_quickstart_keeps_learning_to_the_end(tmp_path):
  """Issue 36, item 7: the main job, the CLI's default config untouched (35 s to 2 minutes on 2
  cores, hence the marker), ends at its lowest validation loss or within 1% of it. A reduced
  budget is no check of this: before about 300k tokens the non-IID arrivals still swing the
  loss (200k tokens, evaluated every 20k: lowest 2.958 at 41k, 3.792 at 102k, final 3.048)."""
  assert train.main([f"--workdir={tmp_path}", "--config.quiet=true"]) == 0
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  losses = [row["val_loss"] for row in rows if row.get("event") == "eval"]
  assert len(losses) == 7  # at 0, every 100k tokens and at the end
  assert losses[-1] <= 1.01 * min(losses), losses
  assert losses[-1] < 0.5 * losses[0], losses
  # The README's line, within the tolerance it states: XLA's CPU code depends on the cores
  # and the vector ISA it finds (2026-12-02, the 2-core Intel Xeon AVX-512: 2.700 on 2 cores,
  # 2.641 on one; 2026-11-28 on this project's 2-core machines: AMD EPYC AVX-512,
  # 2.686 on 2 cores, 2.693 on one, 2.677 / 2.641 with XLA_FLAGS=--xla_cpu_max_isa=AVX2 / AVX;
  # AVX2, 2.644 on 2 cores, 2.653 on one, 2.715 with AVX).
  readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
  first, last = map(float, re.search(r"val_loss (\d\.\d+) -> (\d\.\d+)`", readme).groups())
  assert "within 3%" in readme
  assert round(losses[0], 3) == first
  assert losses[-1] == pytest.approx(last, rel=0.03), (losses[-1], last)
