"""Validation loss over the fixed held-out set, overall and per language.

The held-out set (``heloco_jax.lm.data``: an equal share of every language,
fixed across methods and seeds) lives on device, cut into equal chunks; one
jitted call maps the model over the chunks with ``lax.map`` and returns the
mean token loss per language and overall (the mean over languages, which is
the mean over sequences when every language has the same share).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


class Evaluator:
  """Jitted validation loss of a model on a fixed held-out set.

  Args:
    token_losses: ``(params, sequences (n, context + 1)) -> (n, context)``
      next-token losses (e.g. ``functools.partial(model.token_losses, graphdef)``).
    tokens: int tokens (N, context + 1).
    language_ids: int (N,), indices into ``languages``.
    languages: language names, for ``as_metrics``.
    chunk_size: sequences per forward pass (bounds memory).
  """

  def __init__(self, token_losses: Callable[[Any, jax.Array], jax.Array], tokens: np.ndarray, language_ids: np.ndarray,
               languages: list[str], chunk_size: int = 64):
    tokens = np.asarray(tokens, np.int32)
    language_ids = np.asarray(language_ids, np.int32)
    if tokens.ndim != 2 or len(tokens) != len(language_ids) or not len(tokens):
      raise ValueError(f"Evaluator: tokens of shape {tokens.shape} and language_ids of shape "
                       f"{language_ids.shape} are not allowed; allowed: (N, context + 1) and "
                       "(N,) with N >= 1.")
    self.languages = list(languages)
    chunk_size = min(chunk_size, len(tokens))
    pad = -len(tokens) % chunk_size
    weights = np.concatenate([np.ones(len(tokens), np.float32), np.zeros(pad, np.float32)])
    tokens = np.concatenate([tokens, np.zeros((pad, tokens.shape[1]), np.int32)])
    language_ids = np.concatenate([language_ids, np.zeros(pad, np.int32)])
    chunks = len(tokens) // chunk_size
    self._tokens = jnp.asarray(tokens.reshape(chunks, chunk_size, -1))
    self._one_hot = jnp.asarray(
        (np.eye(len(self.languages), dtype=np.float32)[language_ids] * weights[:, None])
        .reshape(chunks, chunk_size, -1))

    def losses(params):
      def chunk_loss(inputs):
        sequences, one_hot = inputs
        per_sequence = jnp.mean(token_losses(params, sequences), axis=-1)
        return one_hot.T @ per_sequence, jnp.sum(one_hot, axis=0)
      totals, counts = jax.lax.map(chunk_loss, (self._tokens, self._one_hot))
      per_language = jnp.sum(totals, axis=0) / jnp.sum(counts, axis=0)
      return jnp.mean(per_language), per_language

    self._losses = jax.jit(losses)

  def __call__(self, params: Any) -> tuple[jax.Array, jax.Array]:
    """(overall validation loss, per-language losses (L,)), on device."""
    return self._losses(params)

  def as_metrics(self, params: Any) -> dict[str, float]:
    """``{"val_loss": ..., "val_loss/<lang>": ...}`` as Python floats (one host transfer)."""
    overall, per_language = jax.device_get(self(params))
    metrics = {"val_loss": float(overall)}
    metrics.update({f"val_loss/{lang}": float(v) for lang, v in zip(self.languages, per_language)})
    return metrics
