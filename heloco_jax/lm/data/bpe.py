"""A byte-level BPE vocabulary trained offline on a corpus (HF ``tokenizers``).

``heloco-jax corpus bpe --out=DIR [--vocab-size=8192]`` (and ``heloco-jax corpus
debian_docs ...``, after building) trains a byte-level BPE on the corpus's
training text and stores it as ``DIR/tokenizer.json``; runs use it with
``--config.data.tokenizer=DIR/tokenizer.json``. Nothing is downloaded: the
vocabulary is learnt from the corpus itself. The byte tokenizer
(``heloco_jax.lm.data.tokenizer``) stays the default of the quickstart and tests.

Training text: each language's documents in order, without their last
``HOLDOUT`` share of bytes. The pipeline's validation set is the tail of each
language's token stream (a few thousand tokens), so the vocabulary never
sees the text it is evaluated on.

Ids: ``BOS`` (``<|bos|>``) is id 0 and starts every document, as ``BOS_ID`` does
for bytes; a packed stream reads ``BOS doc0 BOS doc1 ...``.
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

import numpy as np

BOS = "<|bos|>"
HOLDOUT = 0.1  # the tail share of each language's bytes kept out of the vocabulary's training
DEFAULT_VOCAB_SIZE = 8192
FILENAME = "tokenizer.json"


def _tokenizers():
  try:
    import tokenizers  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError("a BPE vocabulary needs HF tokenizers: pip install tokenizers") from None
  return tokenizers


def training_text(documents: dict[str, Sequence[bytes]], holdout: float = HOLDOUT
                  ) -> Iterable[str]:
  """Each language's documents without their last ``holdout`` share of bytes."""
  for docs in documents.values():
    left = int((1.0 - holdout) * sum(len(d) for d in docs))
    for doc in docs:
      if left <= 0:
        break
      yield doc[:left].decode("utf-8", errors="ignore")  # a long document is cut
      left -= len(doc)


def train(documents: dict[str, Sequence[bytes]], vocab_size: int = DEFAULT_VOCAB_SIZE,
          holdout: float = HOLDOUT) -> "BPETokenizer":
  """Trains a byte-level BPE of ``vocab_size`` ids (BOS included) on ``documents``.

  Args:
    documents: per language, its documents' UTF-8 bytes in order.
    vocab_size: ids in all, from 258 (BOS + 256 bytes + one merge) to 65535.
    holdout: the tail share of each language's bytes not trained on.

  Raises:
    ValueError: ``vocab_size`` outside [258, 65535].
  """
  if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not (
      258 <= vocab_size <= 65535):
    raise ValueError(f"vocab_size={vocab_size!r} is not allowed; allowed: an integer in "
                     "[258, 65535] (BOS, the 256 bytes and at least one merge)")
  tk = _tokenizers()
  tokenizer = tk.Tokenizer(tk.models.BPE())
  tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = tk.decoders.ByteLevel()
  trainer = tk.trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=[BOS], show_progress=False,
      initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator(training_text(documents, holdout), trainer=trainer)
  return BPETokenizer(tokenizer)


def load(path: str) -> "BPETokenizer":
  """The vocabulary stored at ``path`` (a ``tokenizer.json``, or a folder holding one).

  Raises:
    ValueError: no such file, or not a vocabulary written by ``train``.
  """
  if os.path.isdir(path):
    path = os.path.join(path, FILENAME)
  if not os.path.isfile(path):
    raise ValueError(f"tokenizer={path!r} is not allowed; allowed: a {FILENAME} written by "
                     "`heloco-jax corpus bpe --out=DIR` (or 'bytes')")
  try:
    tokenizer = _tokenizers().Tokenizer.from_file(path)
  except Exception as error:  # pylint: disable=broad-except  (its own error types)
    raise ValueError(f"tokenizer={path!r} cannot be read: {str(error).splitlines()[0]}"
                     ) from None
  if tokenizer.token_to_id(BOS) != 0:
    raise ValueError(f"tokenizer={path!r} has no {BOS} at id 0; allowed: a vocabulary "
                     "written by `heloco-jax corpus bpe`")
  return BPETokenizer(tokenizer)


class BPETokenizer:
  """A trained vocabulary: ``pack`` documents into one stream, ``decode`` ids."""

  bos_id = 0

  def __init__(self, tokenizer):
    self._tokenizer = tokenizer
    self.vocab_size = tokenizer.get_vocab_size()

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._tokenizer.encode(text).ids, np.int64)

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    return self._tokenizer.decode([int(i) for i in np.asarray(ids).reshape(-1)],
                                  skip_special_tokens=True)

  def pack(self, documents: Sequence[bytes]) -> np.ndarray:
    """``BOS doc0 BOS doc1 ...`` as one uint16 stream; empty documents are skipped."""
    texts = [d.decode("utf-8", errors="replace") for d in documents if d]
    parts = []
    for encoding in self._tokenizer.encode_batch(texts, add_special_tokens=False):
      parts.append(np.asarray([self.bos_id, *encoding.ids], np.uint16))
    return np.concatenate(parts) if parts else np.zeros((0,), np.uint16)

  def save(self, path: str) -> None:
    """Writes the vocabulary (tokenizer.json) at once, never through a link at ``path``."""
    from heloco_jax.rundir import safe_files  # pylint: disable=g-import-not-at-top
    safe_files.write_atomic(path, self._tokenizer.to_str())
