"""heloco_jax.lm.data: tokenizer, packing, sources, partitions, iterators, validation set.

Most checks use the synthetic languages. Every training or validation row is a
window of one language's packed stream, so a table from windows to languages
(``_row_languages``) tells the language of any row exactly. Small corpora (``SMALL`` bytes per
language) and short contexts keep the file fast; a few tests use a corpus so
small that the iterators wrap around several epochs.
"""

from __future__ import annotations

import functools
import gzip
import json
import math

import numpy as np
import pytest

from heloco_jax.lm import data
from heloco_jax.lm.data import partition as partition_lib
from heloco_jax.lm.data import sources

SMALL = 20_000
CONTEXT = 32
BATCH = 8


def _make(**kwargs) -> data.Data:
  args = dict(max_bytes_per_language=SMALL, context=CONTEXT, batch_size=BATCH,
              val_sequences_per_language=4)
  args.update(kwargs)
  return data.make_data(**args)


def _take(iterator, n: int) -> np.ndarray:
  return np.stack([next(iterator) for _ in range(n)])


def _synthetic_word_by_word(language: str, num_bytes: int) -> tuple[bytes, ...]:
  """The synthetic generator's definition, one word at a time (``synthetic_documents`` follows
  all sentences of a chunk at once), on the same statistics and draws."""
  lang = sources._synthetic_language(language)
  documents, pieces, total, word = [], [], 0, 0
  while total < num_bytes:
    ranks, starts, kinds = sources._synthetic_chunk(lang)
    for t in range(len(kinds)):
      pieces.append(lang.vocab[word] + sources._SEPARATORS[kinds[t]])
      total += len(pieces[-1])
      word = int(starts[t]) if kinds[t] else int(lang.successors[word][ranks[t]])
      if kinds[t] == 3 or total >= num_bytes:
        documents.append("".join(pieces).encode("ascii"))
        pieces = []
        if total >= num_bytes:
          break
  documents[-1] = documents[-1][:len(documents[-1]) - (total - num_bytes)]
  return tuple(documents)


@pytest.mark.parametrize("language,num_bytes", [("syn0", 1), ("syn1", 2_500), ("syn2", 99_991),
                                                ("syn7", 300_000)])
def test_synthetic_documents_follow_the_word_by_word_definition(language, num_bytes):
  documents = sources.synthetic_documents(language, num_bytes)
  assert documents == _synthetic_word_by_word(language, num_bytes)
  assert sum(map(len, documents)) == num_bytes


@functools.lru_cache(maxsize=None)
def _window_languages() -> dict[bytes, int]:
  """Every (CONTEXT + 1)-token window of the default synthetic streams → its language."""
  table: dict[bytes, int] = {}
  for k, lang in enumerate(data.SYNTHETIC_LANGUAGES[:5]):
    stream = data.pack(sources.synthetic_documents(lang, SMALL)).astype(np.int32)
    for row in np.lib.stride_tricks.sliding_window_view(stream, CONTEXT + 1):
      key = row.tobytes()
      table[key] = k if table.get(key, k) == k else -1  # -1: found in two languages
  return table


def _row_languages(batches: np.ndarray) -> np.ndarray:
  """The synthetic language of every sequence (asserts each is a window of exactly one)."""
  rows = batches.reshape(-1, batches.shape[-1]).astype(np.int32)
  langs = np.array([_window_languages().get(row.tobytes(), -1) for row in rows])
  assert np.all(langs >= 0), "a sequence is not a window of exactly one language"
  return langs


def _windows(stream: np.ndarray, context: int) -> np.ndarray:
  """All windows at multiples of ``context`` that fit in ``stream``."""
  return np.lib.stride_tricks.sliding_window_view(stream, context + 1)[::context]


def _contains(windows: np.ndarray, rows: np.ndarray) -> np.ndarray:
  return np.array([np.any(np.all(windows == row, axis=1)) for row in rows])


# ---------------------------------------------------------------------------------------
# tokenizer and packing


def test_byte_tokenizer_round_trips_any_text():
  text = "Grüße, naïve café — 東京 🙂\nend"
  ids = data.encode(text)
  assert ids.dtype == np.uint8 and len(ids) == len(text.encode("utf-8"))
  assert data.decode(ids) == text
  assert data.decode(ids.astype(np.int32).tolist()) == text
  assert data.decode(np.concatenate([[data.BOS_ID], ids, [data.BOS_ID]])) == text
  assert (data.VOCAB_SIZE, data.BOS_ID) == (257, 256)


def test_pack_puts_bos_before_every_document():
  stream = data.pack([b"ab", b"", "é".encode(), b"c"])
  np.testing.assert_array_equal(stream, [256, 97, 98, 256, 0xC3, 0xA9, 256, 99])
  assert stream.dtype == np.uint16


def test_batches_are_packed_windows_with_bos_separators():
  ds = _make(languages=["syn2"], num_workers=1)
  batches = _take(ds.worker_iterator(0), 50)
  assert batches.shape == (50, BATCH, CONTEXT + 1) and batches.dtype == np.int32
  assert batches.min() >= 0 and batches.max() < data.VOCAB_SIZE
  assert np.any(batches == data.BOS_ID)
  stream = data.pack(sources.synthetic_documents("syn2", SMALL))
  assert _contains(_windows(stream, CONTEXT), batches.reshape(-1, CONTEXT + 1)).all()


# ---------------------------------------------------------------------------------------
# partitions


def test_non_iid_worker_sees_only_its_language():
  ds = _make(num_workers=7)  # more workers than languages: round robin
  assert ds.languages == ["syn0", "syn1", "syn2", "syn3", "syn4"]
  for worker in range(7):
    np.testing.assert_array_equal(ds.worker_mixture(worker), np.eye(5)[worker % 5])
    np.testing.assert_array_equal(_row_languages(_take(ds.worker_iterator(worker), 40)),
                                  worker % 5)


def test_dirichlet_workers_read_their_drawn_mixtures():
  ds = _make(partition="dirichlet", dirichlet_alpha=0.5, num_workers=3, seed=3)
  n = 300 * BATCH
  for worker in range(3):
    mixture = ds.worker_mixture(worker)
    assert mixture.shape == (5,) and math.isclose(mixture.sum(), 1.0)
    freq = np.bincount(_row_languages(_take(ds.worker_iterator(worker), 300)), minlength=5) / n
    # Each period of 5 * 2^14 sequences holds the exact counts in a random order, so the
    # first n are a draw without replacement: at most binomial spread. 5σ, and exact
    # zeros for absent languages.
    tolerance = 5 * np.sqrt(mixture * (1 - mixture) / n)
    assert np.all(np.abs(freq - mixture) <= tolerance), (worker, freq, mixture)
  mixtures = np.stack([ds.worker_mixture(w) for w in range(3)])
  assert not np.allclose(mixtures[0], mixtures[1])
  again = _make(partition="dirichlet", dirichlet_alpha=0.5, num_workers=3, seed=3)
  np.testing.assert_array_equal(again.worker_mixture(2), mixtures[2])
  other = _make(partition="dirichlet", dirichlet_alpha=0.5, num_workers=3, seed=4)
  assert not np.allclose(other.worker_mixture(0), mixtures[0])


def test_small_alpha_skews_and_large_alpha_evens_out():
  skewed = partition_lib.mixtures("dirichlet", 5, 200, 0.05, seed=0)
  even = partition_lib.mixtures("dirichlet", 5, 200, 1000.0, seed=0)
  assert np.all(skewed.sum(axis=1) == 5 << 14) and np.all(even.sum(axis=1) == 5 << 14)
  assert np.median(skewed.max(axis=1)) > 0.9 * (5 << 14)
  assert np.all(np.abs(even / (5 << 14) - 0.2) < 0.05)


def test_iid_workers_mix_all_languages_evenly():
  ds = _make(partition="iid", num_workers=2)
  n = 200 * BATCH
  for worker in range(2):
    np.testing.assert_allclose(ds.worker_mixture(worker), 0.2)
    batches = _take(ds.worker_iterator(worker), 200)
    freq = np.bincount(_row_languages(batches), minlength=5) / n
    assert np.all(np.abs(freq - 0.2) <= 5 * np.sqrt(0.2 * 0.8 / n))
    per_batch = [len(np.unique(_row_languages(b))) for b in batches]
    assert np.mean(per_batch) > 3


# ---------------------------------------------------------------------------------------
# iterators


@pytest.mark.parametrize("partition", ["non_iid", "iid", "dirichlet"])
def test_iterator_state_round_trips_across_epochs(partition):
  # ~2.3k-token languages: an epoch is a few batches, so 60 batches wrap many times.
  ds = _make(partition=partition, num_workers=2, max_bytes_per_language=2_500)
  it = ds.worker_iterator(1)
  _take(it, 17)
  state = it.get_state()
  expected = _take(it, 60)
  fresh = ds.worker_iterator(1)
  fresh.set_state(state)
  np.testing.assert_array_equal(_take(fresh, 60), expected)


def test_epochs_cover_every_window_and_are_reshuffled():
  ds = _make(languages=["syn1"], num_workers=1, max_bytes_per_language=2_500, batch_size=1)
  stream = data.pack(sources.synthetic_documents("syn1", 2_500))
  head = stream[:len(stream) - 4 * (CONTEXT + 1)]
  windows = _windows(head, CONTEXT)
  rows = _take(ds.worker_iterator(0), 3 * len(windows))[:, 0]
  for epoch in np.split(rows, 3):
    order = [int(np.flatnonzero(np.all(windows == row, axis=1))[0]) for row in epoch]
    assert sorted(order) == list(range(len(windows)))
  assert not np.array_equal(rows[:len(windows)], rows[len(windows):2 * len(windows)])


def test_same_arguments_same_batches_and_workers_independent():
  a = _take(_make(partition="iid").worker_iterator(0), 20)
  np.testing.assert_array_equal(_take(_make(partition="iid").worker_iterator(0), 20), a)
  assert not np.array_equal(_take(_make(partition="iid").worker_iterator(1), 20), a)
  assert not np.array_equal(_take(_make(partition="iid", seed=1).worker_iterator(0), 20), a)


# ---------------------------------------------------------------------------------------
# validation set


def test_validation_is_an_equal_held_out_tail_per_language():
  ds = _make(num_workers=5)
  assert ds.validation_tokens.shape == (5 * 4, CONTEXT + 1)
  assert ds.validation_tokens.dtype == np.int32
  assert ds.validation_language_ids.dtype == np.int32
  np.testing.assert_array_equal(np.bincount(ds.validation_language_ids), [4] * 5)
  np.testing.assert_array_equal(_row_languages(ds.validation_tokens), ds.validation_language_ids)
  for k, lang in enumerate(ds.languages):
    stream = data.pack(sources.synthetic_documents(lang, SMALL))
    tail = stream[len(stream) - 4 * (CONTEXT + 1):].reshape(4, CONTEXT + 1)
    np.testing.assert_array_equal(ds.validation_tokens[ds.validation_language_ids == k], tail)
    rows = _take(ds.worker_iterator(k), 200).reshape(-1, CONTEXT + 1)
    head = stream[:len(stream) - 4 * (CONTEXT + 1)]
    assert _contains(_windows(head, CONTEXT), rows).all()  # training stays before the tail
    assert not _contains(tail, rows).any()


def test_validation_does_not_depend_on_method_or_seed():
  base = _make()
  for kwargs in [dict(partition="iid", seed=5), dict(partition="dirichlet", num_workers=3,
                                                      seed=9, batch_size=2)]:
    other = _make(**kwargs)
    np.testing.assert_array_equal(other.validation_tokens, base.validation_tokens)
    np.testing.assert_array_equal(other.validation_language_ids, base.validation_language_ids)


# ---------------------------------------------------------------------------------------
# file sources


def _text(lo: int, n: int, seed: int) -> str:
  """n characters from the 10 letters chr(lo)..chr(lo + 9)."""
  return "".join(chr(lo + c) for c in np.random.default_rng(seed).integers(0, 10, n))


def test_text_dir_reads_folders_and_files(tmp_path):
  (tmp_path / "aa").mkdir()
  (tmp_path / "aa" / "1.txt").write_text(_text(ord("a"), 1500, 0))
  (tmp_path / "aa" / "2.txt").write_text(_text(ord("a"), 1500, 1))
  (tmp_path / "aa" / "notes.md").write_text("ignored")
  (tmp_path / "bb.txt").write_text(_text(ord("A"), 3000, 2))
  (tmp_path / "empty").mkdir()
  (tmp_path / "manifest.json").write_text("{}")
  ds = data.make_data(source="text_dir", path=str(tmp_path), num_workers=2, context=16,
                      batch_size=4, val_sequences_per_language=3)
  assert ds.languages == ["aa", "bb"]
  for worker, (lo, hi) in enumerate([(ord("a"), ord("j")), (ord("A"), ord("J"))]):
    seen = np.unique(_take(ds.worker_iterator(worker), 50))
    assert np.all(((seen >= lo) & (seen <= hi)) | (seen == data.BOS_ID))
  assert np.count_nonzero(ds.validation_tokens == data.BOS_ID) == 0  # tail of 2.txt / bb.txt
  capped = data.make_data(source="text_dir", path=tmp_path, languages=["aa"], num_workers=1,
                          context=16, batch_size=4, val_sequences_per_language=3,
                          max_bytes_per_language=1600)
  rows = _take(capped.worker_iterator(0), 50).reshape(-1, 17)
  stream = data.pack([(tmp_path / "aa" / "1.txt").read_bytes(),
                      (tmp_path / "aa" / "2.txt").read_bytes()[:100]])
  np.testing.assert_array_equal(capped.validation_tokens, stream[-51:].reshape(3, 17))
  assert _contains(_windows(stream[:-51], 16), rows).all()


def test_jsonl_reads_c4_files(tmp_path):
  for name, lo, seeds in [("c4_de_00000.jsonl.gz", ord("a"), [0, 1]),
                          ("c4_de_00001.jsonl.gz", ord("a"), [2]),
                          ("c4_fr_00000.jsonl.gz", ord("A"), [3, 4, 5])]:
    with gzip.open(tmp_path / name, "wt", encoding="utf-8") as f:
      for seed in seeds:
        f.write(json.dumps({"text": _text(lo, 600, seed), "url": "x"}) + "\n")
  (tmp_path / "readme.txt").write_text("not a language")
  ds = data.make_data(source="jsonl", path=str(tmp_path), languages=["fr", "de"],
                      num_workers=2, context=16, batch_size=4, val_sequences_per_language=3)
  assert ds.languages == ["fr", "de"]
  fr = np.unique(_take(ds.worker_iterator(0), 30))
  assert np.all(((fr >= ord("A")) & (fr <= ord("J"))) | (fr == data.BOS_ID))
  de = _take(ds.worker_iterator(1), 100).reshape(-1, 17)
  stream = data.pack([_text(ord("a"), 600, s).encode() for s in [0, 1, 2]])
  assert _contains(_windows(stream[:-51], 16), de).all()
  assert np.count_nonzero(stream == data.BOS_ID) == 3


# ---------------------------------------------------------------------------------------
# tfds


def test_tfds_source_with_mock_data():
  tfds = pytest.importorskip("tensorflow_datasets",
                             reason="tensorflow-datasets is not installed (extra 'tfds')")

  def as_data_source(builder, split, **kwargs):
    del kwargs
    lo = {"de": ord("a"), "fr": ord("A")}[builder.builder_config.name]
    return [{"sentence1": _text(lo, 120, i), "sentence2": "unused"} for i in range(20)]

  with tfds.testing.mock_data(as_data_source_fn=as_data_source):
    ds = data.make_data(source="tfds", path="paws_x_wiki/{lang}", languages=["de", "fr"],
                        text_field="sentence1", num_workers=2, context=16, batch_size=4,
                        val_sequences_per_language=3)
  assert ds.languages == ["de", "fr"]
  for worker, lo in enumerate([ord("a"), ord("A")]):
    seen = np.unique(_take(ds.worker_iterator(worker), 30))
    assert np.all(((seen >= lo) & (seen < lo + 10)) | (seen == data.BOS_ID))

  with tfds.testing.mock_data(num_examples=40):  # random examples; a split per language
    ds = data.make_data(source="tfds", path="lm1b", split="{lang}", languages=["train", "test"],
                        num_workers=2, context=8, batch_size=2, val_sequences_per_language=2)
  assert next(ds.worker_iterator(1)).shape == (2, 9)


# ---------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("kwargs, match", [
    (dict(source="csv"), "source='csv' is not allowed; allowed: one of 'synthetic'"),
    (dict(partition="skewed"), "partition='skewed' is not allowed; allowed: one of 'non_iid'"),
    (dict(dirichlet_alpha=0.0), "dirichlet_alpha=0.0 is not allowed; allowed: a finite number > 0"),
    (dict(dirichlet_alpha=-1), "dirichlet_alpha=-1"),
    (dict(dirichlet_alpha=float("nan")), "dirichlet_alpha=nan"),
    (dict(num_workers=0), "num_workers=0 is not allowed; allowed: an integer >= 1"),
    (dict(num_workers=2.0), "num_workers=2.0 is not allowed"),
    (dict(context=0), "context=0 is not allowed; allowed: an integer >= 1"),
    (dict(batch_size=0), "batch_size=0 is not allowed; allowed: an integer >= 1"),
    (dict(val_sequences_per_language=0), "val_sequences_per_language=0 is not allowed"),
    (dict(seed=-1), "seed=-1 is not allowed; allowed: an integer >= 0"),
    (dict(max_bytes_per_language=0), "max_bytes_per_language=0 is not allowed; allowed: an "
     "integer >= 1 or None"),
    (dict(languages=["syn0", "klingon"]), "languages=\\['syn0', 'klingon'\\] is not allowed; "
     "allowed: None or a list of distinct languages among: syn0, syn1"),
    (dict(languages=["syn0", "syn0"]), "languages=\\['syn0', 'syn0'\\] is not allowed"),
    (dict(languages=[]), "languages=\\[\\] is not allowed"),
    (dict(source="text_dir"), "path=None is not allowed; allowed: with source='text_dir', a "
     "directory holding <lang>/\\*.txt or <lang>.txt files"),
    (dict(source="jsonl", path="/nonexistent"), "path='/nonexistent' is not allowed; allowed: "
     "with source='jsonl', a directory holding c4_<lang>_\\*.jsonl.gz files"),
    (dict(source="tfds"), "path=None is not allowed; allowed: with source='tfds'"),
    (dict(source="tfds", path="lm1b"), "languages=None is not allowed; allowed: with "
     "source='tfds'"),
    (dict(source="tfds", path="lm1b", languages=["a", "b"]), "path='lm1b' is not allowed; "
     "allowed: with several tfds languages, a dataset name or a split \\(split='train'\\) "
     "containing {lang}"),
    (dict(max_bytes_per_language=300), "language 'syn0' has 3.. tokens; it needs at least 389: "
     "val_sequences_per_language=4 held-out sequences of context\\+1=33 tokens plus one batch "
     "of batch_size=8 training windows \\(257 tokens\\)"),
])
def test_invalid_arguments_raise_one_clear_error(kwargs, match):
  with pytest.raises(ValueError, match="^make_data: " + match):
    _make(**kwargs)


def test_file_source_errors(tmp_path):
  with pytest.raises(ValueError, match="none found there"):
    data.make_data(source="text_dir", path=tmp_path)
  with gzip.open(tmp_path / "c4_de_0.jsonl.gz", "wt") as f:
    f.write(json.dumps({"content": "abc"}) + "\n")
  with pytest.raises(ValueError, match="text_field='text' is not allowed; allowed: a field of "
                     "every record; .*c4_de_0.jsonl.gz:1 has \\['content'\\]"):
    data.make_data(source="jsonl", path=tmp_path)


def test_worker_index_and_decode_errors():
  ds = _make(num_workers=2)
  with pytest.raises(ValueError, match="worker_iterator: worker=2 is not allowed; "
                     "allowed: an integer in \\[0, 2\\)"):
    ds.worker_iterator(2)
  with pytest.raises(ValueError, match="worker_mixture: worker=-1 is not allowed"):
    ds.worker_mixture(-1)
  with pytest.raises(ValueError, match="decode: id 257 is not allowed"):
    data.decode([1, 257])
