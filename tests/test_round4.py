"""Issue 78 (reliability round 4): eval_fn's first result checked whole, a run's result never
lost at its end, workdir files holding JSON of the wrong kind, metric names that meet, and
renamed keywords named with their new home."""

import itertools
import json
import os

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from test_hostile_inputs import _data, _loss  # the two-weight linear regression

import heloco_jax as hj
from heloco_jax.rundir import workdir as workdir_lib

def _simulate(**more):
  kwargs = dict(inner_tx=optax.sgd(0.05), inner_steps=2, speeds=[1.0, 2.0],
                budget=hj.Budget(steps=8))
  kwargs.update(more)
  return hj.simulate(_loss, {"w": jnp.zeros((2, 1), jnp.float32)}, [_batches(0), _batches(1)],
                     **kwargs)


def _batches(worker):
  """Worker ``worker``'s 16 batches as a list (re-iterable: a workdir run resumes it)."""
  return list(itertools.islice(_data(worker), 16))


def _val(p):
  return jnp.sum(p["w"] ** 2)


# T2 (a result kept to the end, then KeyError: 'val_loss' in _summary) and T3 (complex).
@pytest.mark.parametrize("result, message", [
    (None, r"eval_fn returned None; allowed: a real scalar loss"),
    ((1.0, 2.0), r"eval_fn returned a tuple; allowed: a real scalar loss"),
    ({"val_loss": {"x": 1.0}}, r"eval_fn returned 'val_loss' a dict; allowed: a real scalar"),
    ({"val_loss": 1.0, "acc": None}, r"eval_fn returned 'acc' None; allowed: real scalars"),
    ({"val_loss": 1.0, "acc": (1.0,)}, r"eval_fn returned 'acc' a tuple; allowed: real scal"),
    (1 + 2j, r"eval_fn returned 'val_loss' complex128; allowed: real scalars"),
    ({"val_loss": 1.0, "c": jnp.complex64(1j)}, r"eval_fn returned 'c' complex64; allowed: re"),
])
def test_eval_fn_first_result_is_checked_whole_before_training(result, message):
  calls = []
  def eval_fn(p):
    calls.append(1)
    return result
  with pytest.raises(ValueError, match=message) as raised:
    _simulate(eval_fn=eval_fn)
  assert "\n" not in str(raised.value)
  assert len(calls) == 1  # refused at the first evaluation, before any training


def test_a_nested_eval_value_still_reaches_the_row():
  result = _simulate(eval_fn=lambda p: {"val_loss": _val(p), "a": {"b": 2.0}})
  assert result.history[-1]["a/b"] == 2.0
  assert result.summary["final_val_loss"] == result.history[-1]["val_loss"]


def test_an_eval_fn_that_fails_at_the_end_keeps_the_run(tmp_path):
  """An eval_fn whose last result is not allowed: the run's rows, summary.json and result are
  kept, with a warning and the reason in the summary (before: KeyError in _summary, or the
  refusal, and nothing returned or written after the training)."""
  calls = []
  def eval_fn(p):
    calls.append(1)
    return _val(p) if len(calls) == 1 else {"other": 1.0}
  with pytest.warns(UserWarning, match=r"the evaluation at the end failed: ValueError: eval_fn "
                    r"returned a dict with keys \['other'\]"):
    result = _simulate(eval_fn=eval_fn, workdir=str(tmp_path / "run"))
  assert result.summary["steps"] == 8 and len(calls) == 2
  assert result.summary["final_val_loss"] is None
  assert "eval_fn returned a dict" in result.summary["final_eval_error"]
  with open(tmp_path / "run" / "summary.json") as f:
    assert json.load(f)["final_eval_error"] == result.summary["final_eval_error"]


@pytest.mark.parametrize("record", ["999999\n", "[1, 2]\n", "\"pid\"\n", "null\n"])
def test_a_lock_record_that_is_not_an_object_is_taken_as_no_record(tmp_path, record):
  """T4: before, AttributeError: 'int' object has no attribute 'get', for every run."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "lock").write_text(record)
  result = _simulate(workdir=str(workdir))
  assert result.summary["steps"] == 8
  assert (workdir / "lock").read_text() == ""  # released at the end


def _unfinished(tmp_path, **more):
  """A workdir whose run finished, made unfinished again (summary.json removed): a resume
  restores its last checkpoint, at the end of the run."""
  workdir = str(tmp_path / "run")
  result = _simulate(workdir=hj.Workdir(workdir, checkpoint_every=1), **more)
  os.remove(os.path.join(workdir, "summary.json"))
  return workdir, result


@pytest.mark.parametrize("text, kind", [("[1, 2]\n", "a list"), ("3\n", "a int"),
                                        ("\"x\"\n", "a str"), ("null\n", "null")])
def test_a_config_json_that_is_not_an_object_is_one_line(tmp_path, text, kind):
  """T5: before, AttributeError: 'list' object has no attribute 'items' in _flatten."""
  workdir, _ = _unfinished(tmp_path)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(text)
  with pytest.raises(workdir_lib.WorkdirError) as raised:
    _simulate(workdir=hj.Workdir(workdir, checkpoint_every=1))
  message = str(raised.value)
  assert "\n" not in message
  assert f"config.json holds {kind}, not a JSON object" in message


def _with_metrics(metrics):
  def loss_fn(params, batch):
    return _loss(params, batch), metrics
  return loss_fn


@pytest.mark.parametrize("metrics, message", [
    ({"a/b": 1.0, "a": {"b": 2.0}}, r"returned two metrics named 'a/b'"),
    ({"a": {"b": 2.0}, "a/b": 1.0}, r"returned two metrics named 'a/b'"),
    ({"": 1.0}, r"returned a metric named '' \(in 'the dict'\); allowed: non-empty names"),
    ({"a": {"": 1.0}}, r"returned a metric named '' \(in 'a'\); allowed: non-empty names"),
])
def test_metric_names_that_meet_or_are_empty_are_refused(metrics, message):
  """S1: before, {"a/b": 1.0, "a": {"b": 2.0}} wrote one train_a/b (1.0) and dropped 2.0; a
  metric named '' was written as train_."""
  with pytest.raises(ValueError, match=r"loss_fn\(params, batch\) " + message) as raised:
    hj.simulate(_with_metrics(metrics), {"w": jnp.zeros((2, 1), jnp.float32)},
                [_data(0), _data(1)], inner_tx=optax.sgd(0.05), inner_steps=2,
                budget=hj.Budget(steps=8))
  assert "\n" not in str(raised.value)
  with pytest.raises(ValueError, match=r"eval_fn " + message):
    _simulate(eval_fn=lambda p: {"val_loss": _val(p), **metrics})


def _cli_line(capsys, argv):
  """The one line ``heloco-jax train argv`` ends with (exit status 2)."""
  from heloco_jax.cli import train  # pylint: disable=g-import-not-at-top
  assert train.main(argv) == 2
  err = capsys.readouterr().err
  lines = err.strip().splitlines()
  assert "Traceback" not in err and lines[0].startswith("heloco-jax train: "), err
  return lines[0]


def test_a_config_file_that_is_not_python_is_one_clear_line(tmp_path, capsys):
  """Before: "does not load: AttributeError: 'NoneType' object has no attribute 'loader'"."""
  path = tmp_path / "hostname"
  path.write_text("myhost\n")
  line = _cli_line(capsys, [f"--workdir={tmp_path / 'run'}", f"--config={path}"])
  assert f"--config={str(path)!r} is not a Python file (its name does not end in .py)" in line
  assert "NoneType" not in line


@pytest.mark.parametrize("argv, flag", [
    (["--config.seed=1", "--config.seed=2"], "--config.seed"),
    (["--config.seed=1", "--config.seed", "2"], "--config.seed"),
    (["--workdir=/tmp/a"], "--workdir"),
])
def test_a_flag_given_twice_is_refused_naming_it(tmp_path, capsys, argv, flag):
  """Before: the last --config.seed won silently."""
  line = _cli_line(capsys, [f"--workdir={tmp_path / 'run'}", *argv])
  assert f"{flag} is given twice; allowed: once" in line
  assert not (tmp_path / "run").exists()


def test_a_cgad_age_decay_refusal_names_the_config_key(tmp_path, capsys):
  """Before: the refusal named config.outer.decay, which is no key."""
  line = _cli_line(capsys, [f"--workdir={tmp_path / 'run'}", "--config.method=cgad",
                            "--config.outer.age_decay=1e300"])
  assert line.startswith("heloco-jax train: config.outer.age_decay=1e+300 is not allowed"), line


def _state_loss(params, batch, *, state):
  return _loss(params, batch), ({"n": state["n"] + 1.0}, {})


def test_an_eval_fn_taking_state_without_model_state_is_one_line():
  """Before: the user's own TypeError (missing keyword 'state') at the first evaluation."""
  def eval_fn(params, *, state):
    return _val(params) + state["n"]
  with pytest.raises(ValueError, match=r"^eval_fn takes the keyword state, but model_state is "
                     r"None; allowed: model_state="):
    _simulate(eval_fn=eval_fn)
  # a default for state is no requirement
  assert "val_loss" in _simulate(eval_fn=lambda params, *, state=None: _val(params)).history[0]


def test_an_eval_fn_without_state_beside_a_model_state_is_warned_of_once():
  """Before: its evaluations silently did not see the run's model state."""
  params = {"w": jnp.zeros((2, 1), jnp.float32)}
  with pytest.warns(UserWarning, match=r"eval_fn does not take the keyword state") as caught:
    hj.simulate(_state_loss, params, [_data(0), _data(1)], inner_tx=optax.sgd(0.05),
                inner_steps=2, budget=hj.Budget(steps=8), eval_fn=_val,
                model_state={"n": jnp.zeros((), jnp.float32)})
  assert sum("keyword state" in str(w.message) for w in caught) == 1


def test_a_garbage_line_in_metrics_jsonl_on_resume_names_the_file_and_line(tmp_path):
  """Before: "Expecting value: line 1 column 1 (char 0)", naming neither."""
  workdir, _ = _unfinished(tmp_path)
  path = os.path.join(workdir, "metrics.jsonl")
  with open(path) as f:
    lines = f.readlines()
  lines[2] = "#" * (len(lines[2]) - 1) + "\n"  # the same bytes and rows: the checkpoint's
  with open(path, "w") as f:
    f.writelines(lines)
  with pytest.raises(workdir_lib.WorkdirError) as raised:
    _simulate(workdir=hj.Workdir(workdir, checkpoint_every=1))
  message = str(raised.value)
  assert "\n" not in message
  assert message.startswith(f"{path}, line 3, is not a JSON row (Expecting value")


# ---------------------------------------------------------------- upgrade-safe workdirs

def _stopped_run(tmp_path, budget=16):
  """A workdir holding a run stopped after its first arrival rows (checkpointed)."""
  import asyncio  # pylint: disable=g-import-not-at-top
  workdir = str(tmp_path / "run")
  engine = hj.make_engine(_loss, {"w": jnp.zeros((2, 1), jnp.float32)},
                          [_batches(0), _batches(1)], inner_tx=optax.sgd(0.05), inner_steps=2,
                          speeds=[1.0, 2.0], budget=hj.Budget(steps=budget),
                          workdir=hj.Workdir(workdir, checkpoint_every=1))
  engine.on_row = lambda row: engine.request_stop() if row["event"] == "arrival" else None
  try:
    with pytest.raises(hj.Stopped):
      asyncio.run(engine.run())
  finally:
    engine.close()
  return workdir


def _edit_config(workdir, edit):
  path = os.path.join(workdir, "config.json")
  with open(path) as f:
    config = json.load(f)
  edit(config)
  with open(path, "w") as f:
    json.dump(config, f)
  return config


def test_an_api_workdir_without_a_key_at_its_default_resumes_bit_for_bit(tmp_path):
  """Before: WorkdirError: ... differing keys: seed (absent -> 0)."""
  whole = _simulate(budget=hj.Budget(steps=16))
  workdir = _stopped_run(tmp_path)
  config = _edit_config(workdir, lambda c: (c.pop("seed"), c.pop("config_schema", None)))
  assert "seed" not in config and config["params"] == [[2, 1]]
  resumed = _simulate(budget=hj.Budget(steps=16), workdir=hj.Workdir(workdir, checkpoint_every=1))
  assert resumed.summary["steps"] == 16
  np.testing.assert_array_equal(resumed.params["w"], whole.params["w"])  # bit for bit
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["config_schema"] == 1  # the resume records today's layout


def test_a_workdir_of_the_oldest_layout_resumes(tmp_path):
  """Every key today's API records at its RunSpec default, absent (as a version that did not
  know them wrote it), with no config_schema: it resumes; the fixture lists today's keys."""
  workdir = _stopped_run(tmp_path)
  with open(os.path.join(workdir, "config.json")) as f:
    today = json.load(f)
  fixture = os.path.join(os.path.dirname(__file__), "rundir", "fixtures", "api_config_v1.json")
  with open(fixture) as f:
    recorded = json.load(f)
  assert sorted(today) == sorted(recorded), "a new key: its old value in workdir_lib.ADDED"
  assert recorded["config_schema"] == workdir_lib.SCHEMA_VERSION
  def oldest(config):
    for key in ("config_schema", "seed", "fragments", "overlap_steps", "fragment_alpha",
                "fragment_layout", "palsgd_coins", "rejection_limit", "dylu", "jitter",
                "worker_batching"):
      config.pop(key)
  _edit_config(workdir, oldest)
  resumed = _simulate(budget=hj.Budget(steps=16), workdir=hj.Workdir(workdir, checkpoint_every=1))
  assert resumed.summary["steps"] == 16


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(seed=5), r"differing keys: seed \(5 -> 0\)\. Use a new workdir"),
    (lambda c: c.update(config_schema=99), r"records config_schema=99, a layout newer than"),
])
def test_a_recorded_value_that_differs_is_still_refused_in_one_line(tmp_path, edit, message):
  workdir = _stopped_run(tmp_path)
  _edit_config(workdir, edit)
  with pytest.raises(workdir_lib.WorkdirError, match=message) as raised:
    _simulate(budget=hj.Budget(steps=16), workdir=hj.Workdir(workdir, checkpoint_every=1))
  assert "\n" not in str(raised.value)


@pytest.mark.parametrize("name, value, home", [
    ("budget_steps", 100, r"budget=hj\.Budget\(steps=\.\.\.\)"),
    ("checkpoint_every", 5, r"workdir=hj\.Workdir\(path, checkpoint_every=\.\.\.\)"),
    ("fragments", 2, r"streaming=hj\.Streaming\(fragments=\.\.\.\)"),
    ("grace_window", 1.0, r"syncer=hj\.Syncer\(grace_window=\.\.\.\)"),
])
@pytest.mark.parametrize("call", ["simulate", "make_engine"])
def test_a_renamed_keyword_is_refused_in_one_line_naming_its_new_home(call, name, value, home):
  """Before: Python's bare "unexpected keyword argument 'budget_steps'"."""
  with pytest.raises(TypeError, match=rf"^{call}\(\) got {name}=, which was renamed: use "
                     rf"{home} \(CHANGELOG\.md\)$"):
    getattr(hj, call)(_loss, {"w": jnp.zeros((2, 1), jnp.float32)}, [_batches(0)],
                      **{name: value})


def test_no_module_of_the_package_imports_in_a_circle_type_checking_imports_too():
  """Before: runtime/state.py imported runtime/streaming.py, which imported state's Run under
  TYPE_CHECKING (tests/test_layout.py's graph leaves those out)."""
  import ast  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  root = pathlib.Path(hj.__file__).parent
  def name(path):
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
  modules = {name(p): p for p in root.rglob("*.py") if p.name != "__init__.py"}
  graph = {}
  for module, path in modules.items():
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        found |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
      elif isinstance(node, ast.Import):
        found |= {a.name for a in node.names}
    graph[module] = {m for m in found if m in modules and m != module}
  def reaches(start, goal, seen):
    return any(n == goal or (n not in seen and not seen.add(n) and reaches(n, goal, seen))
               for n in graph[start])
  circles = sorted(m for m in graph if any(reaches(other, m, set()) for other in graph[m]))
  assert not circles, circles


def _nan_state_loss(params, batch, *, state):
  """A new state that is NaN at every step, used by neither the loss nor the evaluation."""
  return _loss(params, batch), ({"n": state["n"] * jnp.nan, "count": state["count"] + 1}, {})


@pytest.mark.parametrize("method", ["mla", "diloco", "ddp"])
def test_a_model_state_that_is_not_finite_is_warned_of_once_naming_its_leaf(method):
  """Before: the run ended "done" with an all-NaN model_state, without a word."""
  params = {"w": jnp.zeros((2, 1), jnp.float32)}
  with pytest.warns(UserWarning, match=r"model_state leaf 'n' is not finite") as caught:
    result = hj.simulate(
        _nan_state_loss, params, [_data(0), _data(1)], method=method, inner_tx=optax.sgd(0.05),
        inner_steps=2, budget=hj.Budget(steps=8),
        eval_fn=lambda params, *, state: _val(params),
        model_state={"n": jnp.zeros((), jnp.float32), "count": jnp.zeros((), jnp.int32)})
  messages = [str(w.message) for w in caught if "not finite" in str(w.message)]
  assert len(messages) == 1 and "\n" not in messages[0], messages
  assert "loss_fn's new state" in messages[0]
  assert np.isnan(result.model_state["n"])  # returned as it is: the run goes on


def test_a_finite_model_state_gives_no_warning():
  import warnings  # pylint: disable=g-import-not-at-top
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    hj.simulate(_state_loss, {"w": jnp.zeros((2, 1), jnp.float32)}, [_data(0), _data(1)],
                inner_tx=optax.sgd(0.05), inner_steps=2, budget=hj.Budget(steps=8),
                eval_fn=lambda params, *, state: _val(params),
                model_state={"n": jnp.zeros((), jnp.float32)})


def test_a_cli_workdir_of_the_layout_before_config_schema_and_distributed_timeout_resumes(
    tmp_path, capsys):
  """The CLI's config.json records config_schema (as the API's); one written before it and
  before distributed.timeout resumes and ends as the uninterrupted run; a newer
  config_schema is refused in one line."""
  from heloco_jax.cli import train  # pylint: disable=g-import-not-at-top
  base = ["--config.num_workers=2", "--config.model.d_model=32", "--config.model.num_layers=1",
          "--config.model.context=16", "--config.batch_size=4", "--config.inner_steps=2",
          "--config.data.max_bytes_per_language=40000",
          "--config.data.val_sequences_per_language=8", "--config.budget.eval_every_tokens=1000",
          "--config.method=mla", "--config.budget.tokens=2000", "--config.checkpoint.every=4"]

  def outputs():  # metrics.jsonl, and summary.json but its wall-clock fields
    with open(os.path.join(workdir, "summary.json")) as f:
      summary = {k: v for k, v in json.load(f).items()
                 if k not in ("wall_seconds", "tokens_per_second")}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      return f.read(), summary

  workdir = str(tmp_path / "run")
  assert train.main([f"--workdir={workdir}", *base]) == 0
  reference = outputs()
  os.remove(os.path.join(workdir, "summary.json"))  # as if killed after its last checkpoint
  path = os.path.join(workdir, "config.json")
  with open(path) as f:
    config = json.load(f)
  assert config["config_schema"] == workdir_lib.SCHEMA_VERSION
  del config["config_schema"], config["distributed"]["timeout"]
  with open(path, "w") as f:
    json.dump(config, f)
  assert train.main([f"--workdir={workdir}", *base]) == 0
  assert outputs() == reference
  with open(path) as f:
    config = json.load(f)
  assert config["config_schema"] == 1 and config["distributed"]["timeout"] == 60.0
  os.remove(os.path.join(workdir, "summary.json"))
  config["config_schema"] = 99
  with open(path, "w") as f:
    json.dump(config, f)
  capsys.readouterr()
  assert train.main([f"--workdir={workdir}", *base]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "records config_schema=99, a layout newer than" in err[0], err
