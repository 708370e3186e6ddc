"""notebooks/staleness_effects.ipynb: committed with its outputs (its figures show when the
repository is browsed), paired with a jupytext script, and it executes in its fast setting.

The executed test runs the notebook with nbclient in a ``python3`` kernel (jupyter_client
starts it with this interpreter) and ``HELOCO_NOTEBOOK_FAST=1``, which shrinks the model,
H and the token budget so that it takes well under a minute on 2 CPU cores.
"""

import ast
import pathlib
import re

import pytest

# Dev dependencies; an image without them (a GPU machine running from source) skips the module.
nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

# One worker process runs this module, so the notebook (a module fixture) executes once.
pytestmark = pytest.mark.xdist_group("notebook")

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "staleness_effects.ipynb"
KNOBS = {"METHODS", "SPEEDS", "INNER_STEPS", "NUM_WORKERS", "PARTITION", "DIRICHLET_ALPHA",
         "JITTER", "TOKENS", "SEEDS", "D_MODEL", "NUM_LAYERS", "NUM_HEADS", "CONTEXT",
         "BATCH_SIZE", "FAST"}
# Staleness histograms, alignment, loss vs tokens / simulated time, per-language losses.
MIN_FIGURES = 4
CELL_TIMEOUT_S = 240


def _read():
  return nbformat.read(NOTEBOOK, as_version=4)


def _parameters(nb) -> dict:
  """The literal assignments of the cell tagged ``parameters`` (papermill style)."""
  cells = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
  assert len(cells) == 1, f"{len(cells)} cells tagged 'parameters'; expected exactly 1"
  assert cells[0].cell_type == "code"
  values = {}
  for node in ast.parse(cells[0].source).body:
    if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
      try:
        values[node.targets[0].id] = ast.literal_eval(node.value)
      except ValueError:
        values[node.targets[0].id] = None  # not a literal (FAST reads the environment)
  return values


def _text(cell) -> str:
  return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def test_committed_notebook_shows_its_outputs_and_has_one_parameters_cell():
  nb = _read()
  nbformat.validate(nb)
  assert nb.nbformat == 4
  assert nb.metadata["kernelspec"]["name"] == "python3"
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert code, "the notebook has no code cells"
  # Executed top to bottom in one go (re-run it after editing; see notebooks/README.md).
  assert [c.execution_count for c in code] == list(range(1, len(code) + 1))
  outputs = [o for c in code for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(images) >= MIN_FIGURES, f"{len(images)} committed figures"
  assert "FAST mode" not in "".join(_text(c) for c in code), "committed from the fast setting"
  params = _parameters(nb)
  assert KNOBS <= set(params), f"missing knobs: {sorted(KNOBS - set(params))}"
  assert params["METHODS"] and all(isinstance(m, str) for m in params["METHODS"])


def test_the_paired_script_holds_the_same_cells():
  jupytext = pytest.importorskip("jupytext")
  nb = _read()
  script = jupytext.read(NOTEBOOK.with_suffix(".py"))
  assert [(c.cell_type, c.source) for c in script.cells] == [
      (c.cell_type, c.source) for c in nb.cells], (
      "notebooks/staleness_effects.py and .ipynb differ: jupytext --sync "
      "notebooks/staleness_effects.ipynb")


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
  """The notebook after execution in its fast setting."""
  nb = _read()
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("HELOCO_NOTEBOOK_FAST", "1")
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=CELL_TIMEOUT_S, startup_timeout=120,
        resources={"metadata": {"path": str(tmp_path_factory.mktemp("notebook"))}})
    client.execute()  # raises CellExecutionError (with the traceback) if any cell fails
  return nb


def test_notebook_runs_in_fast_mode(executed):
  out = "".join(_text(c) for c in executed.cells if c.cell_type == "code")
  assert "FAST mode:" in out, "HELOCO_NOTEBOOK_FAST=1 did not select the fast setting"
  errors = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]
  assert not errors, f"error outputs: {[o.get('ename') for o in errors]}"


def test_notebook_shows_its_figures(executed):
  images = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs
            if "image/png" in o.get("data", {})]
  assert len(images) >= MIN_FIGURES, f"{len(images)} figures; expected >= {MIN_FIGURES}"


def test_every_method_trains_and_is_in_the_summary(executed):
  methods = _parameters(executed)["METHODS"]
  out = "".join(_text(c) for c in executed.cells if c.cell_type == "code")
  for method in methods:
    # The progress line of its run: the validation loss went down.
    match = re.search(rf"^{re.escape(method)} +seed \d+ [.\s]*val_loss (\S+) -> (\S+),", out,
                      flags=re.M)
    assert match, f"no progress line for {method}"
    initial, final = float(match.group(1)), float(match.group(2))
    assert final < initial, f"{method}: val_loss {initial} -> {final}"
  summary = next((_text(c) for c in executed.cells if c.get("id") == "summary"), "")
  rows = {line.split("|")[1].strip(): line for line in summary.splitlines()
          if line.startswith("|")}
  assert rows.pop("method", None) and rows.pop("---", None), "no summary table header"
  assert set(rows) == set(methods), f"summary rows {sorted(rows)}; expected {sorted(methods)}"
  for method, line in rows.items():
    final_loss = float(line.split("|")[4].split("±")[0])
    assert 0.0 < final_loss < 6.0, f"{method}: final val loss {final_loss}"
