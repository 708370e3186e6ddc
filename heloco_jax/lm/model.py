"""Decoder-only GPT in flax.nnx (DESIGN.md: TinyGPT defaults).

TinyGPT: d_model 128, 8 layers, 4 heads, context 128, learned positions,
pre-LayerNorm, GELU MLP of width 4·d_model, untied output head, byte-level
vocabulary (256 bytes + BOS). Attention goes through
``jax.nn.dot_product_attention`` with ``is_causal=True``: the cuDNN flash
kernel on GPUs in bfloat16 (where it applies), XLA's elsewhere
(``model.attention`` chooses; ``attention_implementation``).

Mixed precision (``compute_dtype="bfloat16"``): matmuls and activations run
in bfloat16; the parameters (``param_dtype``) stay float32, so the gradients,
AdamW's state, the pseudo-gradients and the outer step do too; the logits are
cast back to float32 for the loss. A user's flax.nnx model does the same by
passing ``dtype=jnp.bfloat16, param_dtype=jnp.float32`` to its layers.

Training code never holds the Module: it holds ``graphdef`` and the
parameters as a plain nested dict (``nnx.to_pure_dict``), so optax, the outer
rules, checkpoints and logging all see an ordinary pytree with readable leaf
paths (``blocks/0/attn/qkv/kernel``), and ``apply`` merges them back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from heloco_jax.training import determinism

BYTE_VOCAB_SIZE = 257  # 256 bytes + BOS (heloco_jax.lm.data.BOS_ID = 256)
COMPUTE_DTYPES = ("float32", "bfloat16")
ATTENTIONS = ("auto", "xla", "cudnn")  # model.attention (attention_implementation)
INIT_STD = 0.02  # GPT-2's initialisation: N(0, 0.02²), residual outputs / √(2·layers)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Sizes of the GPT; the defaults are TinyGPT's."""
  vocab_size: int = BYTE_VOCAB_SIZE
  d_model: int = 128
  num_layers: int = 8
  num_heads: int = 4
  context: int = 128
  mlp_ratio: int = 4
  compute_dtype: str = "float32"
  attention: str = "auto"

  def __post_init__(self):
    if self.compute_dtype not in COMPUTE_DTYPES:
      raise ValueError(f"model.compute_dtype={self.compute_dtype!r} is not allowed; allowed: "
                       f"one of {', '.join(COMPUTE_DTYPES)}.")
    if self.attention not in ATTENTIONS:
      raise ValueError(f"model.attention={self.attention!r} is not allowed; allowed: one of "
                       f"{', '.join(ATTENTIONS)}.")
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "context", "mlp_ratio"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"model.{name}={value!r} is not allowed; allowed: an integer >= 1.")
    if self.d_model % self.num_heads:
      raise ValueError(f"model.num_heads={self.num_heads!r} is not allowed; allowed: a divisor "
                       f"of model.d_model={self.d_model}.")


def config_from(model: Any, vocab_size: int = BYTE_VOCAB_SIZE) -> ModelConfig:
  """The ``ModelConfig`` of a run config's ``model`` section (cli/configs/default.py), for a
  vocabulary of ``vocab_size`` ids (the data's)."""
  return ModelConfig(vocab_size=vocab_size, d_model=model.d_model, num_layers=model.num_layers,
                     num_heads=model.num_heads, context=model.context,
                     compute_dtype=model.get("compute_dtype", "float32"),
                     attention=model.get("attention", "auto"))


def attention_implementation(dtype: Any, head_dim: int, choice: str = "auto") -> str:
  """``jax.nn.dot_product_attention``'s implementation for ``model.attention=choice``.

  "auto": "cudnn" (flash) on a GPU in bfloat16 for head sizes it takes, unless XLA's
  deterministic GPU ops are set, else "xla". With the flag, jax 0.11.2 failed to compile
  cuDNN's attention backward on an H200 (``IndexError: absl::container_internal::
  raw_hash_map<>::at``; docs/DESIGN.md, "Determinism"). "xla": always XLA's. "cudnn":
  cuDNN's also under the flag (XLA then asks cuDNN for its deterministic backward, where
  the installed cuDNN has one; ``benchmarks/gpu_determinism.sh`` measures it).

  Raises:
    ValueError: "cudnn" where cuDNN's kernel does not apply (no GPU, float32, a head size
      that is not a multiple of 8 up to 128).
  """
  fits = (jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
          and head_dim % 8 == 0 and head_dim <= 128)
  if choice == "cudnn" and not fits:
    raise ValueError(
        f"model.attention='cudnn' is not allowed here (backend {jax.default_backend()}, "
        f"{jnp.dtype(dtype).name}, head size {head_dim}); allowed: 'auto' or 'xla' (cuDNN's "
        f"attention needs a GPU, model.compute_dtype=bfloat16 and a head size that is a "
        f"multiple of 8 up to 128)")
  if choice == "cudnn" or (choice == "auto" and fits and not determinism.flag_set()):
    return "cudnn"
  return "xla"


class CausalSelfAttention(nnx.Module):
  """Multi-head causal self-attention with a fused QKV projection.

  The QKV projection has no bias: a key bias shifts every logit of a query
  by the same amount, which softmax cancels, so its gradient is exactly zero
  and Adam would turn the rounding noise in it into ±lr random-walk steps.
  """

  def __init__(self, d_model: int, num_heads: int, out_std: float, *, dtype: Any,
               rngs: nnx.Rngs, attention: str = "auto"):
    self.num_heads = num_heads
    self.implementation = attention_implementation(dtype, d_model // num_heads, attention)
    self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False,
                          kernel_init=nnx.initializers.normal(INIT_STD), dtype=dtype, rngs=rngs)
    self.out = nnx.Linear(d_model, d_model, kernel_init=nnx.initializers.normal(out_std),
                          dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    batch, length, d_model = x.shape
    head_dim = d_model // self.num_heads
    q, k, v = jnp.split(self.qkv(x).reshape(batch, length, 3 * self.num_heads, head_dim), 3, axis=2)
    y = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                     implementation=self.implementation)
    return self.out(y.reshape(batch, length, d_model))


class Block(nnx.Module):
  """Pre-LN transformer block: x + attn(ln(x)); x + mlp(ln(x))."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    d, dtype = config.d_model, jnp.dtype(config.compute_dtype)
    out_std = INIT_STD / (2 * config.num_layers) ** 0.5
    self.ln1 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
    self.attn = CausalSelfAttention(d, config.num_heads, out_std, dtype=dtype, rngs=rngs,
                                    attention=config.attention)
    self.ln2 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
    self.up = nnx.Linear(d, config.mlp_ratio * d, kernel_init=nnx.initializers.normal(INIT_STD),
                         dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(config.mlp_ratio * d, d, kernel_init=nnx.initializers.normal(out_std),
                           dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.ln1(x))
    return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class GPT(nnx.Module):
  """Decoder-only GPT: token + learned position embeddings, blocks, final LN, untied head."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    dtype = jnp.dtype(config.compute_dtype)
    self.embed = nnx.Embed(config.vocab_size, config.d_model,
                           embedding_init=nnx.initializers.normal(INIT_STD), dtype=dtype,
                           rngs=rngs)
    self.pos = nnx.Param(INIT_STD * jax.random.normal(rngs.params(),
                                                      (config.context, config.d_model)))
    self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.num_layers)])
    self.ln_f = nnx.LayerNorm(config.d_model, dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(config.d_model, config.vocab_size,
                           kernel_init=nnx.initializers.normal(INIT_STD), dtype=dtype, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Logits (batch, length, vocab) for int tokens (batch, length <= context), in the
    compute dtype."""
    x = self.embed(tokens)
    x = x + self.pos[: tokens.shape[-1]].astype(x.dtype)
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln_f(x))


# Megatron-style tensor parallelism of the blocks' matrices over a ``tp`` mesh axis (column-
# parallel qkv and up, row-parallel attention output and down), FSDP over ``fsdp`` on their
# other dimension; ``heloco_jax.training.sharding.specs_by_path`` rules. The embedding and the head
# (a vocabulary of any size, e.g. 257) are left to FSDP.
TENSOR_PARALLEL_RULES = (
    (r"(qkv|up)/kernel$", P("fsdp", "tp")), (r"up/bias$", P("tp")),
    (r"(attn/out|down)/kernel$", P("tp", "fsdp")),
)


def init(config: ModelConfig, seed: int) -> tuple[nnx.GraphDef, dict]:
  """Builds the model; returns (graphdef, params as a plain nested dict)."""
  graphdef, state = nnx.split(GPT(config, rngs=nnx.Rngs(params=seed)))
  return graphdef, nnx.to_pure_dict(state)


def apply(graphdef: nnx.GraphDef, params: Any, tokens: jax.Array) -> jax.Array:
  """Logits of the model ``graphdef`` with ``params`` on ``tokens``."""
  return nnx.merge(graphdef, params)(tokens)


def token_losses(graphdef: nnx.GraphDef, params: Any, sequences: jax.Array) -> jax.Array:
  """Next-token cross entropy per position, (batch, context), float32.

  ``sequences`` are (batch, context + 1) tokens: inputs ``[:, :-1]``,
  targets ``[:, 1:]``.
  """
  logits = apply(graphdef, params, sequences[:, :-1]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, sequences[:, 1:])


def loss(graphdef: nnx.GraphDef, params: Any, sequences: jax.Array) -> jax.Array:
  """Mean next-token cross entropy of a batch (nats per token)."""
  return jnp.mean(token_losses(graphdef, params, sequences))


def num_params(params: Any) -> int:
  """Number of scalar parameters."""
  return int(sum(x.size for x in jax.tree.leaves(params)))
