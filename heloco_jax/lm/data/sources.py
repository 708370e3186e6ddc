"""Text sources: each language becomes a list of documents (raw UTF-8 bytes).

Sources:
  synthetic  procedurally generated "languages" ``syn0``..``syn7`` (default: the first
             five). Like real languages that share a script, all write with a-z, space,
             "." and newline, and differ in everything else: letter frequencies, their
             own word list with Zipfian frequencies and word lengths, and a word-bigram
             grammar (every word has a few likely successors). All of it is fixed by the
             language's name, so the corpus, hence the validation set, never depends on
             the run's seed. A small byte-level GPT learns letters and frequent words
             within a few hundred steps; a model trained on one language transfers
             partly to the others (shared script) but has a clearly higher loss there.
             (Disjoint alphabets were tried first: a model fit to one language then
             predicted the others' letters so badly that the average loss rose.)
  text_dir   ``DIR/<lang>/*.txt`` (what ``heloco-jax corpus`` writes) and/or
             ``DIR/<lang>.txt``; one file is one document.
  jsonl      ``DIR/c4_<lang>_*.jsonl.gz``, the multilingual C4 layout; one line is one
             JSON document whose ``text_field`` (default "text") holds the text.
  tfds       any tensorflow-datasets text dataset via ``tfds.data_source``; the
             dataset name (``path``) and/or the ``split`` contain ``{lang}``, replaced
             by each language: ``path="paws_x_wiki/{lang}"`` (a config per language) or
             ``path="my_dataset", split="{lang}"`` (a split per language).

``max_bytes`` caps the text read per language (for ``synthetic``: the size generated,
default ``SYNTHETIC_BYTES_PER_LANGUAGE``); the last document is cut to fit.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import re
import string
from pathlib import Path
from typing import Any, Iterable, Iterator, NamedTuple, Optional, Sequence

import numpy as np

SOURCES = ("synthetic", "text_dir", "jsonl", "tfds")

SYNTHETIC_LANGUAGES = tuple(f"syn{k}" for k in range(8))
DEFAULT_SYNTHETIC_LANGUAGES = SYNTHETIC_LANGUAGES[:5]
SYNTHETIC_BYTES_PER_LANGUAGE = 1 << 20
_SYNTHETIC_SEED = 20250101  # fixed: the synthetic corpus is part of the data config
_SYNTHETIC_CHUNK_WORDS = 1 << 14

_JSONL_PATTERN = re.compile(r"^c4_([^_]+)_.*\.jsonl\.gz$")
_LAYOUTS = {"text_dir": "<lang>/*.txt or <lang>.txt files",
            "jsonl": "c4_<lang>_*.jsonl.gz files"}


def argument_error(name: str, value: Any, allowed: str) -> ValueError:
  """The one-line error of an invalid ``make_data`` argument."""
  return ValueError(f"make_data: {name}={value!r} is not allowed; allowed: {allowed}.")


# ---------------------------------------------------------------------------------------
# synthetic


def synthetic_alphabet(language: str) -> str:
  """The letters of a synthetic language: a-z, shared by all (their frequencies differ)."""
  if language not in SYNTHETIC_LANGUAGES:
    raise argument_error("languages", language, f"synthetic languages {SYNTHETIC_LANGUAGES}")
  return string.ascii_lowercase


_SEPARATORS = (" ", ". ", ".\n", ".")  # after a word: continue, sentence, paragraph, document end


class _SyntheticLanguage(NamedTuple):
  """A synthetic language's statistics, and its generator positioned at the first chunk."""
  rng: np.random.Generator
  vocab: list[str]              # ranked: frequent words are short
  unigram: np.ndarray           # P(word) of a sentence's first word
  successors: np.ndarray        # (vocab, branching): the words that may follow each word
  successor_cdf: np.ndarray     # (branching,): which of them, by rank
  p_sentence_end: float
  p_paragraph_end: float
  p_document_end: float


def _synthetic_language(language: str) -> _SyntheticLanguage:
  """Draws ``language``'s statistics from a generator seeded by its name alone."""
  k = SYNTHETIC_LANGUAGES.index(language)
  rng = np.random.default_rng([_SYNTHETIC_SEED, k])
  letters = np.array(list(synthetic_alphabet(language)))
  letter_p = rng.dirichlet(np.full(len(letters), 2.0))
  mean_length = rng.uniform(2.5, 6.5)
  vocab_size = int(rng.integers(200, 400))
  words: dict[str, None] = {}  # insertion-ordered set
  while len(words) < vocab_size:
    length = 1 + min(int(rng.poisson(mean_length - 1)), 11)
    words["".join(rng.choice(letters, size=length, p=letter_p))] = None
  # Frequent words are short (Zipf's law of abbreviation): rank by length.
  vocab = sorted(words, key=len)
  unigram = 1.0 / np.arange(1, vocab_size + 1) ** rng.uniform(0.9, 1.3)
  unigram /= unigram.sum()
  branching = int(rng.integers(3, 12))
  successors = np.stack([rng.choice(vocab_size, size=branching, replace=False, p=unigram)
                         for _ in range(vocab_size)])
  successor_cdf = np.cumsum(1.0 / np.arange(1, branching + 1))
  successor_cdf /= successor_cdf[-1]
  p_sentence_end = 1.0 / rng.uniform(5.0, 15.0)
  p_paragraph_end = rng.uniform(0.1, 0.4)
  p_document_end = 1.0 / rng.uniform(8.0, 30.0)
  return _SyntheticLanguage(rng, vocab, unigram, successors, successor_cdf, p_sentence_end,
                            p_paragraph_end, p_document_end)


def _synthetic_chunk(lang: _SyntheticLanguage) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The next ``_SYNTHETIC_CHUNK_WORDS`` words' draws: (successor rank, the start word used
  after a sentence end, what follows the word: an index into ``_SEPARATORS``)."""
  n, rng = _SYNTHETIC_CHUNK_WORDS, lang.rng
  ranks = np.searchsorted(lang.successor_cdf, rng.random(n))
  starts = rng.choice(len(lang.vocab), size=n, p=lang.unigram)
  u = rng.random((3, n))
  end_kind = np.minimum(1 + (u[1] < lang.p_paragraph_end) + 2 * (u[2] < lang.p_document_end), 3)
  return ranks, starts, np.where(u[0] < lang.p_sentence_end, end_kind, 0)


@functools.lru_cache(maxsize=2 * len(SYNTHETIC_LANGUAGES))
def synthetic_documents(language: str, num_bytes: int) -> tuple[bytes, ...]:
  """Generates ``num_bytes`` bytes of documents in a synthetic language.

  The statistics (letter frequencies, word lengths, Zipf exponent, number of
  successors per word, sentence and document lengths) are drawn from a
  generator seeded by the language's name alone. Words are generated in fixed
  chunks, so a smaller corpus is a prefix of a larger one.

  Args:
    language: one of ``SYNTHETIC_LANGUAGES``.
    num_bytes: total size of the documents.

  Returns:
    The documents as UTF-8 (ASCII) bytes, ``num_bytes`` in total.
  """
  lang = _synthetic_language(language)

  # The text is a chain of words: after word w comes successors[w][rank], or a random start
  # word after a sentence end. Within a chunk the chain is followed for all sentences at once,
  # one word position at a time.
  piece_text = [word + sep for word in lang.vocab for sep in _SEPARATORS]  # 4 * word + kind
  piece_length = np.array([len(piece) for piece in piece_text])
  documents: list[bytes] = []
  pending = ""  # the text of a document that goes on into the next chunk
  total = 0
  word = 0
  while total < num_bytes:
    ranks, starts, kinds = _synthetic_chunk(lang)
    n = len(kinds)
    words = np.empty(n + 1, dtype=np.int64)
    words[0] = word
    ends = np.flatnonzero(kinds)
    words[ends + 1] = starts[ends]
    sentence_starts = np.concatenate([[0], ends + 1])
    sentence_lengths = np.diff(np.append(sentence_starts, n + 1))  # words[n] begins the next chunk
    for k in range(1, int(sentence_lengths.max())):
      at = sentence_starts[sentence_lengths > k] + k
      words[at] = lang.successors[words[at - 1], ranks[at - 1]]
    codes = 4 * words[:n] + kinds
    lengths = np.cumsum(piece_length[codes])  # the chunk's text length after each word
    reached = np.flatnonzero(total + lengths >= num_bytes)
    used = int(reached[0]) + 1 if reached.size else n
    text = pending + "".join(map(piece_text.__getitem__, codes[:used].tolist()))
    total += int(lengths[used - 1])
    word = int(words[used])
    # Documents end at a document end (kind 3) and where the corpus reaches num_bytes.
    closes = np.flatnonzero(kinds[:used] == 3)
    if total >= num_bytes and (closes.size == 0 or closes[-1] != used - 1):
      closes = np.append(closes, used - 1)
    begin = 0
    for end in (len(pending) + lengths[closes]).tolist():
      documents.append(text[begin:end].encode("ascii"))
      begin = end
    pending = text[begin:]
  documents[-1] = documents[-1][:len(documents[-1]) - (total - num_bytes)]
  return tuple(documents)


# ---------------------------------------------------------------------------------------
# files


def _capped(documents: Iterable[bytes], max_bytes: Optional[int]) -> list[bytes]:
  """Takes documents until ``max_bytes`` bytes; cuts the last one to fit."""
  kept: list[bytes] = []
  total = 0
  for doc in documents:
    if max_bytes is not None and total + len(doc) >= max_bytes:
      kept.append(doc[:max_bytes - total])
      break
    kept.append(doc)
    total += len(doc)
  return kept


def _files(source: str, path: Optional[str | os.PathLike]) -> dict[str, list[Path]]:
  """The files of each language found in ``path`` (text_dir or jsonl layout)."""
  layout = _LAYOUTS[source]
  if path is None or not Path(path).is_dir():
    raise argument_error("path", path, f"with source={source!r}, a directory holding {layout}")
  files = (_text_dir_files if source == "text_dir" else _jsonl_files)(Path(path))
  if not files:
    raise argument_error("path", path, f"with source={source!r}, a directory holding {layout} "
                         "(none found there)")
  return files


def _text_dir_files(root: Path) -> dict[str, list[Path]]:
  files: dict[str, list[Path]] = {}
  for entry in sorted(root.iterdir()):
    if entry.is_dir():
      found = sorted(f for f in entry.glob("*.txt") if f.is_file())
      if found:
        files.setdefault(entry.name, []).extend(found)
    elif entry.is_file() and entry.suffix == ".txt":
      files.setdefault(entry.stem, []).append(entry)
  return files


def _jsonl_files(root: Path) -> dict[str, list[Path]]:
  files: dict[str, list[Path]] = {}
  for entry in sorted(root.iterdir()):
    match = _JSONL_PATTERN.match(entry.name)
    if match and entry.is_file():
      files.setdefault(match.group(1), []).append(entry)
  return files


def _jsonl_documents(files: Sequence[Path], text_field: str) -> Iterator[bytes]:
  for file in files:
    with gzip.open(file, "rt", encoding="utf-8") as f:
      for line_number, line in enumerate(f, 1):
        if not line.strip():
          continue
        record = json.loads(line)
        if text_field not in record:
          raise argument_error("text_field", text_field,
                               f"a field of every record; {file}:{line_number} has "
                               f"{sorted(record)}")
        yield record[text_field].encode("utf-8")


def _tfds_documents(name: str, split: str, data_dir: Optional[str],
                    text_field: str) -> Iterator[bytes]:
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("source='tfds' needs tensorflow-datasets: "
                      "pip install 'heloco-jax[tfds]'") from e
  records = tfds.data_source(name, split=split, data_dir=data_dir)
  for i in range(len(records)):
    record = records[i]
    if text_field not in record:
      raise argument_error("text_field", text_field,
                           f"a feature of {name} split {split!r}: {sorted(record)}")
    text = record[text_field]
    yield text if isinstance(text, bytes) else str(text).encode("utf-8")


# ---------------------------------------------------------------------------------------
# entry point


def _choose(languages: Optional[Sequence[str]], found: Sequence[str]) -> list[str]:
  """Checks the requested languages against those found; None means all found."""
  if languages is None:
    return list(found)
  if (isinstance(languages, str) or not languages
      or len(set(languages)) != len(languages)
      or any(not isinstance(lang, str) or lang not in found for lang in languages)):
    raise argument_error("languages", languages,
                         "None or a list of distinct languages among: "
                         + ", ".join(map(str, found)))
  return list(languages)


def load_documents(
    source: str,
    path: Optional[str | os.PathLike],
    languages: Optional[Sequence[str]],
    max_bytes: Optional[int],
    *,
    split: str = "train",
    data_dir: Optional[str] = None,
    text_field: str = "text",
) -> dict[str, list[bytes]]:
  """Reads every language's documents; see the module docstring for the sources.

  Args:
    source: one of ``SOURCES``.
    path: the directory (text_dir, jsonl) or the dataset name (tfds); unused by
      synthetic.
    languages: the languages to read, in this order, or None for all found
      (synthetic: ``DEFAULT_SYNTHETIC_LANGUAGES``).
    max_bytes: cap on the bytes read per language, or None.
    split: tfds split (may contain ``{lang}``).
    data_dir: tfds ``data_dir``.
    text_field: the text's field in jsonl records and tfds examples.

  Returns:
    ``{language: documents}`` in the order of the languages.

  Raises:
    ValueError: a missing path, no or unknown languages, a missing text field.
  """
  if source == "synthetic":
    chosen = _choose(DEFAULT_SYNTHETIC_LANGUAGES if languages is None else languages,
                     SYNTHETIC_LANGUAGES)
    size = SYNTHETIC_BYTES_PER_LANGUAGE if max_bytes is None else max_bytes
    return {lang: list(synthetic_documents(lang, size)) for lang in chosen}
  if source == "text_dir":
    files = _files(source, path)
    return {lang: _capped((f.read_bytes() for f in files[lang]), max_bytes)
            for lang in _choose(languages, list(files))}
  if source == "jsonl":
    files = _files(source, path)
    return {lang: _capped(_jsonl_documents(files[lang], text_field), max_bytes)
            for lang in _choose(languages, list(files))}
  if source == "tfds":
    if not path:
      raise argument_error("path", path, "with source='tfds', a tensorflow-datasets name "
                           "such as 'paws_x_wiki/{lang}'")
    if languages is None:
      raise argument_error("languages", languages, "with source='tfds', a list of names "
                           "substituted for {lang} in path or split")
    chosen = _choose(languages, languages)
    name = os.fspath(path)
    if len(chosen) > 1 and "{lang}" not in name + split:
      raise argument_error("path", path, "with several tfds languages, a dataset name or a "
                           f"split (split={split!r}) containing {{lang}}")
    return {lang: _capped(_tfds_documents(name.replace("{lang}", lang),
                                          split.replace("{lang}", lang), data_dir,
                                          text_field), max_bytes)
            for lang in chosen}
  raise argument_error("source", source, "one of " + ", ".join(map(repr, SOURCES)))
