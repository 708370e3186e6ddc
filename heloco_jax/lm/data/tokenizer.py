"""Byte-level tokenizer and packing of documents into one flat token stream.

Token ids 0..255 are the bytes of the UTF-8 text; ``BOS_ID = 256`` starts every
document, so a packed stream reads ``BOS doc0 BOS doc1 ...`` and a model sees
where one document ends and the next begins. Nothing is downloaded and no
vocabulary file exists: ``VOCAB_SIZE = 257``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

BOS_ID = 256
VOCAB_SIZE = 257
STREAM_DTYPE = np.uint16  # the smallest unsigned type holding BOS_ID


def encode(text: str) -> np.ndarray:
  """Returns the UTF-8 bytes of ``text`` as a uint8 array of token ids."""
  return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def decode(ids: Sequence[int] | np.ndarray) -> str:
  """Returns the text of byte ids; BOS ids are dropped, invalid UTF-8 replaced.

  Args:
    ids: token ids in [0, VOCAB_SIZE), any integer dtype or a Python sequence.

  Returns:
    The decoded text (``errors="replace"``: a model's samples may cut a
    multi-byte character).

  Raises:
    ValueError: an id outside [0, VOCAB_SIZE).
  """
  ids = np.asarray(ids).reshape(-1)
  if ids.size and (ids.min() < 0 or ids.max() >= VOCAB_SIZE):
    bad = ids[(ids < 0) | (ids >= VOCAB_SIZE)][0]
    raise ValueError(f"decode: id {int(bad)} is not allowed; allowed: integers in "
                     f"[0, {VOCAB_SIZE}) (bytes 0..255 and BOS_ID={BOS_ID}).")
  return ids[ids != BOS_ID].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def pack(documents: Sequence[bytes]) -> np.ndarray:
  """Concatenates documents into one stream, each preceded by ``BOS_ID``.

  Args:
    documents: the raw UTF-8 bytes of each document; empty ones are skipped.

  Returns:
    A flat uint16 array ``BOS doc0 BOS doc1 ...`` of length
    ``sum(1 + len(doc))`` over the non-empty documents.
  """
  documents = [d for d in documents if d]
  lengths = np.fromiter((len(d) for d in documents), dtype=np.int64, count=len(documents))
  body = np.frombuffer(b"".join(documents), dtype=np.uint8).astype(STREAM_DTYPE)
  starts = np.cumsum(lengths) - lengths
  return np.insert(body, starts, BOS_ID)
