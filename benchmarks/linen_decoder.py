"""A Flax Linen decoder layer stack trained on padded sequences, for bench_train_step.py.

The shape of Flax's lm1b example decoder: pre-LayerNorm layers of ``nn.MultiHeadDotProductAttention``
(attention dropout, a (batch, 1, q, kv) float mask from ``nn.combine_masks(nn.make_attention_mask(
tokens > 0, tokens > 0), nn.make_causal_mask(tokens))``) and a GELU MLP, token and learned position
embeddings, optax AdamW, the loss over the non-padding tokens. The data are examples/train_lm.py's
arithmetic progressions (tokens 1 .. vocab - 1) whose last eighth is padding (token 0), so that the
padding mask is real.

``attention`` picks the attention function: "flax" (Linen's own), or jax_softmax's plug-in with its
``implementation`` (None: its default, "jax_softmax", "cudnn", "flash").
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class DecoderLayer(nn.Module):
    d_model: int
    heads: int
    dropout: float
    dtype: Any
    attention_fn: Any

    @nn.compact
    def __call__(self, x, mask, deterministic: bool):
        kw = {} if self.attention_fn is None else {"attention_fn": self.attention_fn}
        y = nn.LayerNorm(dtype=self.dtype)(x)
        y = nn.MultiHeadDotProductAttention(
            num_heads=self.heads, dtype=self.dtype, dropout_rate=self.dropout,
            deterministic=deterministic, **kw)(y, mask=mask)
        x = x + y
        y = nn.LayerNorm(dtype=self.dtype)(x)
        y = nn.Dense(4 * self.d_model, dtype=self.dtype)(y)
        return x + nn.Dense(self.d_model, dtype=self.dtype)(nn.gelu(y))


class Decoder(nn.Module):
    vocab: int
    seq_len: int
    d_model: int
    layers: int
    heads: int
    dropout: float
    dtype: Any
    attention_fn: Any

    @nn.compact
    def __call__(self, tokens, deterministic: bool):
        mask = nn.combine_masks(nn.make_attention_mask(tokens > 0, tokens > 0, dtype=self.dtype),
                                nn.make_causal_mask(tokens, dtype=self.dtype))
        x = nn.Embed(self.vocab, self.d_model, dtype=self.dtype)(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (self.seq_len, self.d_model))
        x = x + pos[: tokens.shape[-1]].astype(self.dtype)
        for _ in range(self.layers):
            x = DecoderLayer(self.d_model, self.heads, self.dropout, self.dtype, self.attention_fn)(
                x, mask, deterministic)
        return nn.Dense(self.vocab, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))


def make_batch(key, batch: int, seq_len: int, vocab: int):
    """Progressions of tokens 1 .. vocab - 1, the last eighth of each sequence padding (0):
    (inputs, next-token targets, target weights)."""
    k_start, k_step = jax.random.split(key)
    start = jax.random.randint(k_start, (batch, 1), 0, vocab - 1)
    step = jax.random.randint(k_step, (batch, 1), 1, 5)
    seq = 1 + (start + step * jnp.arange(seq_len + 1)[None, :]) % (vocab - 1)
    seq = jnp.where(jnp.arange(seq_len + 1)[None, :] < seq_len - seq_len // 8, seq, 0)
    inputs, targets = seq[:, :-1], seq[:, 1:]
    return inputs, targets, (targets > 0).astype(jnp.float32)


def attention_fn(attention: str):
    if attention == "flax":
        return None
    from jax_softmax.flax import dot_product_attention

    impl = {"plugin": None, "jax_softmax": "jax_softmax", "cudnn": "cudnn", "flash": "flash"}[attention]
    return functools.partial(dot_product_attention, implementation=impl)


def make_trainer(*, seq_len: int = 64, batch: int = 8, d_model: int = 64, layers: int = 2,
                 heads: int = 4, vocab: int = 512, attention: str = "plugin", dtype: str = "float32",
                 dropout: float = 0.0, lr: float = 3e-3, seed: int = 0):
    """The parameters and optimizer state and the jitted step ``train_step(state, key) -> (state,
    loss)``, as examples/train_lm.py's make_trainer()."""
    model = Decoder(vocab, seq_len, d_model, layers, heads, dropout, DTYPES[dtype], attention_fn(attention))
    key = jax.random.key(seed)
    tokens, _, _ = make_batch(key, batch, seq_len, vocab)
    params = model.init(key, tokens, deterministic=True)
    tx = optax.adamw(lr, weight_decay=0.01)

    @jax.jit
    def train_step(state, key):
        params, opt_state = state
        data_key, dropout_key = jax.random.split(key)
        inputs, targets, weights = make_batch(data_key, batch, seq_len, vocab)

        def loss_fn(params):
            logits = model.apply(params, inputs, deterministic=dropout == 0.0,
                                 rngs={"dropout": dropout_key})
            loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
            return jnp.sum(loss * weights) / jnp.sum(weights)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return train_step, (params, tx.init(params))
