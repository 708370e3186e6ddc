"""heloco_jax/lm/data/bpe.py: a byte-level BPE vocabulary trained offline on the corpus, and
runs that use it (``--config.data.tokenizer``)."""

import json
import os

import numpy as np
import pytest

from heloco_jax.cli import train
from heloco_jax.lm.data import bpe, corpus, sources

# One worker process runs this module, so the module's corpus fixture is built once.
pytestmark = pytest.mark.xdist_group("bpe_corpus")

TINY = ["--config.num_workers=2", "--config.model.d_model=32", "--config.model.num_layers=1",
        "--config.model.context=16", "--config.batch_size=4", "--config.inner_steps=2",
        "--config.data.val_sequences_per_language=8", "--config.budget.eval_every_tokens=1000",
        "--config.budget.tokens=4000", "--config.checkpoint.every=0", "--config.speeds=mild"]


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
  """A text_dir corpus of two synthetic languages, 150 kB each, with its vocabulary."""
  root = tmp_path_factory.mktemp("corpus")
  for lang, docs in sources.load_documents("synthetic", None, ["syn0", "syn1"], 150_000).items():
    (root / lang).mkdir()
    (root / lang / "text.txt").write_bytes(b"\n".join(docs))
  assert corpus.main(["bpe", f"--out={root}", "--vocab-size=600"]) == 0
  return root


def test_the_vocabulary_has_the_asked_size_bos_at_zero_and_round_trips(text_dir):
  vocab = bpe.load(str(text_dir / "tokenizer.json"))
  assert vocab.vocab_size == 600 and vocab.bos_id == 0
  text = "Hällo, wörld: ünïcode and bytes \x01 round-trip"
  ids = vocab.encode(text)
  assert vocab.decode(ids) == text and 0 not in ids
  stream = vocab.pack([b"ab ab ab", b"", "cd é".encode()])
  assert stream.dtype == np.uint16 and list(np.flatnonzero(stream == 0)) == [
      0, 1 + len(vocab.encode("ab ab ab"))]  # BOS before each non-empty document
  # It compresses the corpus it was trained on (bytes: 1 id per byte).
  docs = sources.load_documents("text_dir", str(text_dir), None, None)["syn0"]
  assert len(vocab.pack(docs)) < 0.6 * sum(len(d) for d in docs)


def test_the_vocabulary_never_trains_on_the_tail_that_validation_comes_from():
  docs = {"a": [b"x" * 90, b"TAIL" * 5]}  # 110 bytes: the last 10% (11 bytes) are held out
  assert "".join(bpe.training_text(docs)) == "x" * 90 + "TAILTAILT"  # 99 bytes


def test_bad_sizes_and_paths_fail_in_one_line(tmp_path, capsys):
  assert corpus.main(["bpe", f"--out={tmp_path}", "--vocab-size=100"]) == 2
  assert "--vocab-size=100 is not allowed; allowed: 0 (none) or an integer in [258, 65535]" in (
      capsys.readouterr().err)
  with pytest.raises(ValueError, match="tokenizer='/nope' is not allowed"):
    bpe.load("/nope")
  assert train.main([f"--workdir={tmp_path / 'run'}", "--config.data.tokenizer=/nope"]) == 2
  assert "config.data.tokenizer='/nope' is not allowed" in capsys.readouterr().err


def test_a_run_on_the_bpe_vocabulary_sizes_the_model_to_it_and_learns(text_dir, tmp_path):
  common = [*TINY, "--config.data.source=text_dir", f"--config.data.path={text_dir}"]
  assert train.main([f"--workdir={tmp_path / 'bpe'}", *common,
                     f"--config.data.tokenizer={text_dir / 'tokenizer.json'}"]) == 0
  assert train.main([f"--workdir={tmp_path / 'bytes'}", *common]) == 0
  bpe_run, byte_run = (json.loads((tmp_path / name / "summary.json").read_text())
                       for name in ("bpe", "bytes"))
  # The embedding and the head grow from 257 to 600 rows/columns: 2·(600 − 257)·32 + (600 − 257).
  assert bpe_run["num_params"] - byte_run["num_params"] == 2 * (600 - 257) * 32 + (600 - 257)
  assert np.log(600) - 0.1 < bpe_run["initial_val_loss"] < np.log(600) + 0.3
  assert bpe_run["final_val_loss"] < bpe_run["initial_val_loss"] - 0.5
  assert os.path.exists(tmp_path / "bpe" / "metrics.jsonl")
