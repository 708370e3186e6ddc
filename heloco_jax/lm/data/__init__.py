"""Data: byte tokenizer, text sources, partitions across workers, grain pipelines.

::

  from heloco_jax.lm import data
  ds = data.make_data(source="synthetic", partition="non_iid", num_workers=5)
  it = ds.worker_iterator(0)
  batch = next(it)                  # int32 (batch_size, context + 1)
  state = it.get_state()            # restore with it.set_state(state)
  ds.validation_tokens, ds.validation_language_ids

The offline corpus builder (``heloco_jax.lm.data.corpus``) is imported on demand by
the ``heloco-jax corpus`` command, not here.
"""

from heloco_jax.lm.data.partition import PARTITIONS
from heloco_jax.lm.data.pipeline import Data, make_data
from heloco_jax.lm.data.sources import SOURCES, SYNTHETIC_LANGUAGES
from heloco_jax.lm.data.tokenizer import BOS_ID, VOCAB_SIZE, decode, encode, pack

__all__ = [
    "BOS_ID", "Data", "PARTITIONS", "SOURCES", "SYNTHETIC_LANGUAGES", "VOCAB_SIZE", "decode",
    "encode", "make_data", "pack",
]
