"""Train a small causal transformer language model (Flax NNX + optax) with jax_softmax attention.

The task is synthetic: every sequence is an arithmetic progression modulo the vocabulary size,
``x[t] = (start + step * t) % vocab`` with a random start and a random step in ``1..4``. The next
token is predictable once the model has attended to the previous two tokens, so the loss falls
quickly (towards about ``(ln(vocab) + ln(4)) / seq_len``, the unpredictable first two tokens).

Every attention layer is ``flax.nnx.MultiHeadAttention`` with
``attention_fn=jax_softmax.flax.dot_product_attention`` and ``is_causal=True``, so the scaled,
causally masked softmax runs as one fused kernel; ``--no-plugin`` uses Flax's default attention
instead, for comparison.

    python examples/train_lm.py                        # small defaults, a few seconds on CPU
    python examples/train_lm.py --no-plugin            # Flax's own attention
    python examples/train_lm.py --steps 300 --seq-len 512 --batch 32 --d-model 512 \\
        --layers 6 --heads 8 --dtype bfloat16           # a GPU-sized run

From Python (e.g. benchmarks)::

    from train_lm import train
    result = train(steps=20, use_plugin=True)   # {'losses': [...], 'steps_per_sec': ..., ...}
"""

from __future__ import annotations

import argparse
import functools
import inspect
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# Flax >= 0.12 wants nnx.List for a list of submodules; older versions take a plain list.
_ModuleList = getattr(nnx, "List", list)
# Flax >= 0.11: optimizer.update(model, grads); before: optimizer.update(grads).
_UPDATE_TAKES_MODEL = len(inspect.signature(nnx.Optimizer.update).parameters) >= 3


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, d_model: int, heads: int, *, attention_fn, dtype, dropout: float, rngs: nnx.Rngs):
        attn_kw = {} if attention_fn is None else {"attention_fn": attention_fn}
        self.ln1 = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=heads,
            in_features=d_model,
            decode=False,
            dtype=dtype,
            dropout_rate=dropout,
            rngs=rngs,
            **attn_kw,
        )
        self.ln2 = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(d_model, 4 * d_model, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(4 * d_model, d_model, dtype=dtype, rngs=rngs)

    def __call__(self, x, *, deterministic: bool):
        x = x + self.attn(self.ln1(x), is_causal=True, deterministic=deterministic)
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class TransformerLM(nnx.Module):
    def __init__(
        self,
        *,
        vocab: int,
        seq_len: int,
        d_model: int,
        layers: int,
        heads: int,
        attention_fn=None,
        dtype=jnp.float32,
        dropout: float = 0.0,
        rngs: nnx.Rngs,
    ):
        self.dtype = dtype
        self.embed = nnx.Embed(vocab, d_model, dtype=dtype, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, d_model)))
        self.blocks = _ModuleList(
            [
                Block(d_model, heads, attention_fn=attention_fn, dtype=dtype, dropout=dropout, rngs=rngs)
                for _ in range(layers)
            ]
        )
        self.ln_f = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, dtype=dtype, rngs=rngs)

    def __call__(self, tokens, *, deterministic: bool = True):
        x = self.embed(tokens) + self.pos[: tokens.shape[-1]].astype(self.dtype)
        for block in self.blocks:
            x = block(x, deterministic=deterministic)
        return self.head(self.ln_f(x))


def make_batch(key, batch: int, seq_len: int, vocab: int):
    """Arithmetic progressions mod ``vocab``: (inputs, next-token targets), both (batch, seq_len)."""
    k_start, k_step = jax.random.split(key)
    start = jax.random.randint(k_start, (batch, 1), 0, vocab)
    step = jax.random.randint(k_step, (batch, 1), 1, 5)
    seq = (start + step * jnp.arange(seq_len + 1)[None, :]) % vocab
    return seq[:, :-1], seq[:, 1:]


def _attention_fn(use_plugin: bool, implementation: str | None = None):
    if not use_plugin:
        return None  # Flax's default: flax.nnx.dot_product_attention
    from jax_softmax.flax import dot_product_attention

    if implementation is None:
        return dot_product_attention
    return functools.partial(dot_product_attention, implementation=implementation)


def make_trainer(
    *,
    seq_len: int = 32,
    batch: int = 16,
    d_model: int = 64,
    layers: int = 2,
    heads: int = 4,
    vocab: int = 32,
    use_plugin: bool = True,
    implementation: str | None = None,
    dtype: str = "float32",
    lr: float = 3e-3,
    weight_decay: float = 0.01,
    dropout: float = 0.0,
    seed: int = 0,
):
    """The model and optimizer state and the jitted step ``train_step(state, key) -> (state, loss)``
    (not yet compiled). ``implementation``: the plug-in's (jax_softmax.flax.dot_product_attention)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if d_model % heads:
        raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
    model = TransformerLM(
        vocab=vocab,
        seq_len=seq_len,
        d_model=d_model,
        layers=layers,
        heads=heads,
        attention_fn=_attention_fn(use_plugin, implementation),
        dtype=DTYPES[dtype],
        dropout=dropout,
        rngs=nnx.Rngs(params=seed, dropout=seed + 1),
    )
    optimizer = nnx.Optimizer(model, optax.adamw(lr, weight_decay=weight_decay), wrt=nnx.Param)

    # nnx.split/merge around a plain jax.jit keeps the per-step Python overhead low.
    graphdef, state = nnx.split((model, optimizer))

    @jax.jit
    def train_step(state, key):
        model, optimizer = nnx.merge(graphdef, state)
        tokens, targets = make_batch(key, batch, seq_len, vocab)

        def loss_fn(model):
            logits = model(tokens, deterministic=dropout == 0.0)
            return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        if _UPDATE_TAKES_MODEL:
            optimizer.update(model, grads)
        else:
            optimizer.update(grads)
        return nnx.state((model, optimizer)), loss

    return train_step, state


def train(
    *,
    steps: int = 60,
    log_every: int = 1,
    verbose: bool = True,
    trace_dir: str | None = None,
    trace_steps: int = 5,
    **config,
) -> dict[str, Any]:
    """Trains the model (``config``: make_trainer's keywords) and returns ``losses`` (per step),
    ``steps_per_sec`` (excluding the first, compiling step), ``compile_s`` (the first step's wall
    time) and the settings used. With ``trace_dir``, ``trace_steps`` more steps run after the timed
    ones under ``jax.profiler``, whose trace goes there (benchmarks/bench_train_step.py --profile
    reads its GPU timeline)."""
    defaults = {k: p.default for k, p in inspect.signature(make_trainer).parameters.items()}
    config = {**defaults, **config}
    train_step, state = make_trainer(**config)
    seed, use_plugin, implementation = config["seed"], config["use_plugin"], config["implementation"]
    data_key = jax.random.key(seed + 2)
    losses_dev = []
    plugin = "flax default" if not use_plugin else "jax_softmax" + (f" ({implementation})" if implementation else "")
    if verbose:
        settings = " ".join(f"{k}={config[k]}" for k in ("dtype", "seq_len", "batch", "d_model", "layers", "heads", "vocab"))
        print(f"backend={jax.default_backend()} attention={plugin} steps={steps} {settings}", flush=True)
    t0 = time.perf_counter()
    t_first = None
    for i in range(steps):
        state, loss = train_step(state, jax.random.fold_in(data_key, i))
        losses_dev.append(loss)
        if i == 0:
            loss.block_until_ready()
            t_first = time.perf_counter()
        if verbose and (i % log_every == 0 or i == steps - 1):
            print(f"step {i:5d}  loss {float(loss):.4f}", flush=True)
    jax.block_until_ready(state)
    t_end = time.perf_counter()
    if trace_dir is not None:
        # Steady-state steps only: compiled, and after the timed ones (which stay untraced).
        jax.profiler.start_trace(trace_dir)
        for i in range(trace_steps):
            state, _ = train_step(state, jax.random.fold_in(data_key, steps + i))
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
    losses = [float(v) for v in losses_dev]
    compile_s = (t_first or t_end) - t0
    steps_per_sec = (steps - 1) / (t_end - t_first) if steps > 1 and t_end > t_first else float("nan")
    if verbose:
        print(
            f"first step (incl. compile) {compile_s:.2f}s, {steps_per_sec:.1f} steps/s, "
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f}",
            flush=True,
        )
    return {
        "losses": losses,
        "steps_per_sec": steps_per_sec,
        "compile_s": compile_s,
        "attention": plugin,
        "backend": jax.default_backend(),
        "config": {"steps": steps, **{k: v for k, v in config.items() if k not in ("use_plugin", "implementation")}},
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="compute dtype")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dropout", type=float, default=0.0, help="attention dropout rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=1, help="print the loss every N steps")
    p.add_argument("--no-plugin", action="store_true", help="Flax's default attention instead of jax_softmax")
    p.add_argument("--implementation", choices=["jax_softmax", "cudnn", "flash"], default=None,
                   help="force the plug-in's path (default: cuDNN's flash attention where it applies "
                        "without dropout, jax_softmax's flash kernels for causal or masked dropout)")
    return p.parse_args(argv)


def main(argv=None) -> dict[str, Any]:
    a = parse_args(argv)
    return train(
        steps=a.steps,
        seq_len=a.seq_len,
        batch=a.batch,
        d_model=a.d_model,
        layers=a.layers,
        heads=a.heads,
        vocab=a.vocab,
        use_plugin=not a.no_plugin,
        implementation=a.implementation,
        dtype=a.dtype,
        lr=a.lr,
        dropout=a.dropout,
        seed=a.seed,
        log_every=a.log_every,
    )


if __name__ == "__main__":
    result = main(sys.argv[1:])
    sys.exit(0 if result["losses"][-1] < result["losses"][0] else 1)
