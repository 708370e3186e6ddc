"""How the languages are split across workers (ALGORITHMS.md, Data heterogeneity).

  non_iid    worker i reads only language i mod L (the HeLoCo setting).
  iid        every worker reads the mixed corpus: each language an equal share, so the
             data seen by all workers together is the same as under non_iid with K = L.
  dirichlet  worker i's mixture is drawn from Dirichlet(α, ..., α); small α, more skew.

A mixture is realised exactly: it is rounded to integer counts out of a period of
``L * 2^14`` sequences (largest remainders; exact for non_iid and iid), and every
period of a worker's consecutive sequences holds exactly those counts of each
language, in an order shuffled once per worker. ``language_schedule`` gives that
order.
"""

from __future__ import annotations

import numpy as np

PARTITIONS = ("non_iid", "iid", "dirichlet")
_PERIOD_PER_LANGUAGE = 1 << 14


def seeded_rng(seed: int, purpose: int, *keys: int) -> np.random.Generator:
  """A generator for one purpose; keys are padded to a fixed length.

  ``np.random.SeedSequence`` ignores trailing zeros ([s, 1] and [s, 1, 0] give
  the same stream), so every key has the same length.
  """
  return np.random.default_rng([seed, purpose, *keys, *([0] * (3 - len(keys)))])


def mixtures(partition: str, num_languages: int, num_workers: int, alpha: float,
             seed: int) -> np.ndarray:
  """Integer language counts per worker out of a period of ``L * 2^14`` sequences.

  Args:
    partition: one of ``PARTITIONS``.
    num_languages: L.
    num_workers: K.
    alpha: the Dirichlet concentration (dirichlet only).
    seed: seeds the Dirichlet draw (dirichlet only).

  Returns:
    An int64 array (K, L); row i divided by its sum is worker i's mixture.
  """
  if partition == "non_iid":
    exact = np.eye(num_languages)[np.arange(num_workers) % num_languages]
  elif partition == "iid":
    exact = np.full((num_workers, num_languages), 1.0 / num_languages)
  else:
    exact = seeded_rng(seed, 0).dirichlet(np.full(num_languages, alpha), size=num_workers)
  period = num_languages * _PERIOD_PER_LANGUAGE
  scaled = exact * period
  counts = np.floor(scaled).astype(np.int64)
  remainders = scaled - counts
  for row, missing in enumerate(period - counts.sum(axis=1)):
    counts[row, np.argsort(-remainders[row], kind="stable")[:missing]] += 1
  return counts


def language_schedule(counts: np.ndarray, seed: int,
                      worker: int) -> tuple[np.ndarray, np.ndarray]:
  """The order of languages within one period of a worker's sequences.

  Args:
    counts: the worker's row of ``mixtures`` (L,).
    seed: the run's seed.
    worker: the worker's index.

  Returns:
    ``(language, rank)``, two int64 arrays as long as the period
    (``counts.sum()``): the language of each position and how many earlier
    positions of the period have the same language.
  """
  language = seeded_rng(seed, 1, worker).permutation(np.repeat(np.arange(len(counts)), counts))
  order = np.argsort(language, kind="stable")
  first = np.cumsum(counts) - counts
  rank = np.empty(len(language), np.int64)
  rank[order] = np.arange(len(language)) - first[language[order]]
  return language, rank
