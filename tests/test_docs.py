"""Every Python block of README.md and docs/ runs as shown (issue 57), or says it is a listing.

A block preceded by the line ``<!-- listing -->`` is a listing (signatures, an outline with
``...``) and is not run; one preceded by ``<!-- continued -->`` runs after the block before it,
in the same interpreter. Each other block runs alone in a fresh interpreter (some set XLA
flags before importing JAX), with what it prints checked where the page quotes it.
"""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(?:<!-- (listing|continued) -->\n)?```python\n(.*?)```", re.S)


def _programs():
  """(page, index of its first block, the program) for every block or run of continued
  blocks; listings left out."""
  programs = []
  for page in PAGES:
    for index, (marker, code) in enumerate(_BLOCK.findall(page.read_text())):
      if marker == "listing":
        continue
      if marker == "continued":
        assert programs and programs[-1][0] == page.name, f"{page.name} block {index}"
        name, first, before = programs.pop()
        programs.append((name, first, before + "\n" + code))
      else:
        programs.append((page.name, index, code))
  return programs


PROGRAMS = _programs()


def test_every_block_is_run_or_marked_a_listing():
  blocks = sum(len(_BLOCK.findall(page.read_text())) for page in PAGES)
  listings = sum(page.read_text().count("<!-- listing -->\n```python") for page in PAGES)
  assert blocks >= 10 and listings <= 4
  assert len(PROGRAMS) + listings <= blocks


@pytest.mark.parametrize("page, index, code", PROGRAMS,
                         ids=[f"{page}:{index}" for page, index, _ in PROGRAMS])
def test_the_block_runs_as_shown(page, index, code, tmp_path):
  done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, f"{page} block {index}:\n{done.stderr[-3000:]}"
  if page == "FLAX_MODELS.md":  # the page quotes what it prints on this project's machine
    text = (ROOT / "docs" / page).read_text()
    _assert_quoted(text, r"it prints `accuracy ([\d.]+) -> ([\d.]+)`",
                   r"accuracy ([\d.]+) -> ([\d.]+)", done.stdout)
    assert "'train_accuracy'" in done.stdout
    _assert_quoted(text, r"prints `BatchNorm statistics carried ([\d.]+), re-estimated\s+([\d.]+)`",
                   r"carried ([\d.]+), re-estimated ([\d.]+)", done.stdout)
    assert "tutorial style: 4 outer updates" in done.stdout


def _assert_quoted(page_text, quote, output, stdout):
  """The numbers the page quotes (regex ``quote``) are those printed (``output``) within 0.03:
  another CPU may differ in the last digits."""
  quoted, printed = re.search(quote, page_text), re.search(output, stdout)
  assert quoted and printed, stdout
  for want, got in zip(quoted.groups(), printed.groups()):
    assert abs(float(want) - float(got)) <= 0.03, stdout
