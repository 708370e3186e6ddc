"""The GPT: TinyGPT sizes, parameter count, causality, initial loss, config errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from heloco_jax.lm import model


def _expected_count(c: model.ModelConfig) -> int:
  d, v, t, f = c.d_model, c.vocab_size, c.context, c.mlp_ratio * c.d_model
  per_block = 2 * 2 * d + d * 3 * d + (d * d + d) + (d * f + f) + (f * d + d)
  return v * d + t * d + c.num_layers * per_block + 2 * d + (d * v + v)


def test_tinygpt_defaults_and_parameter_count():
  config = model.ModelConfig()
  assert (config.d_model, config.num_layers, config.num_heads, config.context,
          config.vocab_size) == (128, 8, 4, 128, 257)
  _, params = model.init(config, seed=0)
  assert model.num_params(params) == _expected_count(config) == 1_665_793
  assert params["head"]["kernel"].shape == (128, 257)  # untied head
  assert params["embed"]["embedding"].shape == (257, 128)
  assert params["pos"].shape == (128, 128)  # learned positions
  assert "bias" not in params["blocks"][0]["attn"]["qkv"]  # see CausalSelfAttention


def test_logits_are_causal_and_initial_loss_is_near_uniform():
  config = model.ModelConfig(d_model=32, num_layers=2, num_heads=4, context=16)
  graphdef, params = model.init(config, seed=1)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 17)), jnp.int32)
  logits = model.apply(graphdef, params, tokens[:, :-1])
  assert logits.shape == (2, 16, 257)
  changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % 256)
  logits_changed = model.apply(graphdef, params, changed[:, :-1])
  np.testing.assert_allclose(logits[:, :10], logits_changed[:, :10], atol=1e-5)
  assert float(jnp.abs(logits[:, 10:] - logits_changed[:, 10:]).max()) > 1e-4
  # GPT-2 init (N(0, 0.02²)) starts near the uniform distribution over 257 tokens.
  assert abs(float(model.loss(graphdef, params, tokens)) - math.log(257)) < 0.05


def test_same_seed_same_params():
  config = model.ModelConfig(d_model=16, num_layers=1, num_heads=2, context=8)
  a, b = model.init(config, 3)[1], model.init(config, 3)[1]
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)
  c = model.init(config, 4)[1]
  assert float(jnp.abs(a["head"]["kernel"] - c["head"]["kernel"]).max()) > 0


@pytest.mark.parametrize("kwargs, named", [
    (dict(d_model=0), "model.d_model=0"),
    (dict(num_layers=-1), "model.num_layers=-1"),
    (dict(context=2.5), "model.context=2.5"),
    (dict(d_model=130, num_heads=4), "model.num_heads=4"),
])
def test_invalid_sizes(kwargs, named):
  with pytest.raises(ValueError, match="allowed:") as error:
    model.ModelConfig(**kwargs)
  assert named in str(error.value)


def test_bfloat16_compute_keeps_float32_parameters_and_gradients_and_close_losses():
  sizes = dict(d_model=32, num_layers=2, num_heads=4, context=16)
  graphdef, params = model.init(model.ModelConfig(**sizes), seed=0)
  graphdef16, params16 = model.init(model.ModelConfig(**sizes, compute_dtype="bfloat16"), seed=0)
  # The same initial parameters, in float32; only the computation differs.
  assert all(a.dtype == b.dtype == jnp.float32 and np.array_equal(a, b)
             for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params16)))
  sequences = jax.random.randint(jax.random.key(1), (4, 17), 0, model.BYTE_VOCAB_SIZE)
  apply = jax.jit(model.apply, static_argnums=0)  # compiled: op by op takes ~20 s
  assert apply(graphdef16, params16, sequences[:, :-1]).dtype == jnp.bfloat16
  loss_and_grads = jax.jit(jax.value_and_grad(model.loss, argnums=1), static_argnums=0)
  loss32, grads32 = loss_and_grads(graphdef, params, sequences)
  loss16, grads16 = loss_and_grads(graphdef16, params16, sequences)
  assert loss16.dtype == jnp.float32 and {g.dtype for g in jax.tree.leaves(grads16)} == {
      jnp.dtype(jnp.float32)}
  np.testing.assert_allclose(loss16, loss32, rtol=1e-2)
  assert float(loss16) != float(loss32)  # bfloat16 did run
  cosines = [float(jnp.vdot(a, b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b) + 1e-30))
             for a, b in zip(jax.tree.leaves(grads16), jax.tree.leaves(grads32))]
  assert min(cosines) > 0.95, cosines


def test_an_unknown_compute_dtype_is_refused():
  with pytest.raises(ValueError, match="model.compute_dtype='float16' is not allowed; allowed: "
                     "one of float32, bfloat16"):
    model.ModelConfig(compute_dtype="float16")


@pytest.mark.parametrize("platform, dtype, choice, flag, expected", [
    ("gpu", jnp.bfloat16, "auto", False, "cudnn"),
    ("gpu", jnp.bfloat16, "auto", True, "xla"),   # jax 0.11.2: no cuDNN backward under the flag
    ("gpu", jnp.bfloat16, "cudnn", True, "cudnn"),  # asked for: XLA's deterministic cuDNN path
    ("gpu", jnp.bfloat16, "xla", False, "xla"),
    ("gpu", jnp.float32, "auto", False, "xla"),
    ("cpu", jnp.bfloat16, "auto", False, "xla"),
])
def test_model_attention_picks_the_kernel(monkeypatch, platform, dtype, choice, flag, expected):
  monkeypatch.setattr(jax, "default_backend", lambda: platform)
  monkeypatch.setattr(model.determinism, "flag_set", lambda: flag)
  assert model.attention_implementation(dtype, 32, choice) == expected


@pytest.mark.parametrize("platform, dtype, head_dim", [("cpu", jnp.bfloat16, 32),
                                                       ("gpu", jnp.float32, 32),
                                                       ("gpu", jnp.bfloat16, 36)])
def test_cudnn_attention_where_it_cannot_run_is_refused_in_one_line(monkeypatch, platform,
                                                                    dtype, head_dim):
  monkeypatch.setattr(jax, "default_backend", lambda: platform)
  with pytest.raises(ValueError, match=r"^model.attention='cudnn' is not allowed here \(backend "
                     rf"{platform}, {jnp.dtype(dtype).name}, head size {head_dim}\); allowed: "
                     r"'auto' or 'xla'") as error:
    model.attention_implementation(dtype, head_dim, "cudnn")
  assert "\n" not in str(error.value)


def test_model_attention_xla_is_the_cpus_auto_bit_for_bit():
  sizes = dict(d_model=32, num_layers=1, num_heads=4, context=8)
  sequences = jax.random.randint(jax.random.key(2), (2, 8), 0, model.BYTE_VOCAB_SIZE)
  outs = []
  for attention in ("auto", "xla"):
    graphdef, params = model.init(model.ModelConfig(**sizes, attention=attention), seed=0)
    outs.append(np.asarray(jax.jit(model.apply, static_argnums=0)(graphdef, params, sequences)))
  np.testing.assert_array_equal(outs[0], outs[1])
  with pytest.raises(ValueError, match="model.attention='flash' is not allowed; allowed: one of "
                     "auto, xla, cudnn"):
    model.ModelConfig(attention="flash")
