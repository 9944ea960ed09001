"""The pure-jnp oracles and model pieces against plain numpy loops on fresh random data."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inkling_jax.model.short_conv import DynamicShortConvolution, ShortConvolution
from pallas_kernels.moe import moe_experts
from pallas_kernels.relative_attention import relative_attention


def naive_attention(q, k, v, rel, rel_proj, sinks, pos, scale, window):
    batch, length, heads, _ = q.shape
    groups = heads // k.shape[2]
    extent = rel_proj.shape[1]
    out = np.zeros_like(q)
    for b in range(batch):
        for t in range(length):
            for h in range(heads):
                logits = []
                for s in range(length):
                    d = pos[b, t] - pos[b, s]
                    if d < 0 or (window is not None and d >= window):
                        logits.append(-np.inf)
                        continue
                    bias = rel[b, t, h] @ rel_proj[:, d] if d < extent else 0.0
                    logits.append(scale * q[b, t, h] @ k[b, s, h // groups] + bias)
                logits = np.array([*logits, sinks[b, t, h]])
                p = np.exp(logits - logits.max())
                p = p / p.sum()
                out[b, t, h] = p[:-1] @ v[b, :, h // groups]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 5])
def test_relative_attention_matches_loops(window):
    rng = np.random.default_rng(1)
    batch, length, heads, kv_heads, dim, d_rel, extent = 2, 13, 6, 2, 8, 3, 7
    q = rng.normal(size=(batch, length, heads, dim)).astype(np.float32)
    k = rng.normal(size=(batch, length, kv_heads, dim)).astype(np.float32)
    v = rng.normal(size=(batch, length, kv_heads, dim)).astype(np.float32)
    rel = rng.normal(size=(batch, length, heads, d_rel)).astype(np.float32)
    rel_proj = rng.normal(size=(d_rel, extent)).astype(np.float32)
    sinks = rng.normal(size=(batch, length, heads)).astype(np.float32)
    pos = np.stack([np.arange(length), np.arange(length) + 100]).astype(np.int32)
    got = relative_attention(q, k, v, rel, rel_proj, sinks, pos, pos, scale=dim**-0.5, window=window)
    want = naive_attention(q, k, v, rel, rel_proj, sinks, pos, dim**-0.5, window)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_moe_experts_matches_dense_loop():
    rng = np.random.default_rng(2)
    tokens, hidden, inner, experts, top_k = 17, 12, 10, 5, 3
    x = rng.normal(size=(tokens, hidden)).astype(np.float32)
    gate_up = rng.normal(size=(experts, 2 * inner, hidden)).astype(np.float32)
    down = rng.normal(size=(experts, hidden, inner)).astype(np.float32)
    chosen = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)]).astype(np.int32)
    weights = rng.uniform(0.1, 2.0, size=(tokens, top_k)).astype(np.float32)
    got = moe_experts(x, gate_up, down, chosen, weights, gate_cap=1.5, up_cap=2.0)
    want = np.zeros_like(x)
    for n in range(tokens):
        for j in range(top_k):
            e = chosen[n, j]
            g, u = gate_up[e, :inner] @ x[n], gate_up[e, inner:] @ x[n]
            act = np.tanh(g / 1.5) * 1.5 / (1 + np.exp(-g)) * np.tanh(u / 2.0) * 2.0
            want[n] += weights[n, j] * (down[e] @ act)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_moe_experts_on_a_share_of_the_experts_drops_the_rest():
    """Expert parallelism's contract: each shard runs its experts with the others' ids out of range,
    and the shards' fp32 partial sums add up to the whole."""
    rng = np.random.default_rng(3)
    tokens, hidden, inner, experts, top_k, shards = 13, 8, 6, 6, 2, 3
    x = jnp.asarray(rng.normal(size=(tokens, hidden)), jnp.bfloat16)
    gate_up = jnp.asarray(rng.normal(size=(experts, 2 * inner, hidden)), jnp.bfloat16)
    down = jnp.asarray(rng.normal(size=(experts, hidden, inner)), jnp.bfloat16)
    chosen = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)]).astype(np.int32)
    weights = rng.uniform(0.1, 2.0, size=(tokens, top_k)).astype(np.float32)
    caps = {"gate_cap": 1.5, "up_cap": 2.0, "out_dtype": jnp.float32}
    whole = moe_experts(x, gate_up, down, chosen, weights, **caps)
    per = experts // shards
    share = [slice(i * per, (i + 1) * per) for i in range(shards)]
    parts = [moe_experts(x, gate_up[s], down[s], chosen - s.start, weights, **caps) for s in share]
    assert all(np.abs(np.asarray(part)).max() > 0 for part in parts)
    np.testing.assert_allclose(np.asarray(sum(parts)), np.asarray(whole), rtol=1e-5, atol=1e-5)


def test_static_short_conv_matches_loop():
    rng = np.random.default_rng(3)
    conv = ShortConvolution(nnx.Rngs(0), channels=6, kernel_size=4, axis=None, std=1.0)
    weight = rng.normal(size=(6, 1, 4)).astype(np.float32)  # torch layout: tap 3 is the current token
    conv.conv1d.weight.set_value(jnp.asarray(weight))
    x = rng.normal(size=(2, 9, 6)).astype(np.float32)
    want = np.zeros_like(x)
    for t in range(9):
        for j in range(4):
            if t + j - 3 >= 0:
                want[:, t] += weight[:, 0, j] * x[:, t + j - 3]
    want = (want + x) / math.sqrt(5)
    np.testing.assert_allclose(np.asarray(conv(jnp.asarray(x))), want, rtol=1e-5, atol=1e-6)


def test_dynamic_short_conv_matches_loop():
    rng = np.random.default_rng(4)
    heads, head_dim, kernel, hidden = 2, 3, 3, 5
    conv = DynamicShortConvolution(nnx.Rngs(0), heads * head_dim, hidden, heads, kernel, jnp.float32, 1.0)
    static = rng.normal(size=(kernel, heads * head_dim)).astype(np.float32)
    proj = rng.normal(size=(heads * kernel, hidden)).astype(np.float32)
    conv.static_weight.set_value(jnp.asarray(static))
    conv.weight_proj.weight.set_value(jnp.asarray(proj))
    x = rng.normal(size=(1, 7, heads * head_dim)).astype(np.float32)
    source = rng.normal(size=(1, 7, hidden)).astype(np.float32)
    want = np.zeros_like(x)
    for t in range(7):
        dynamic = (proj @ source[0, t]).reshape(heads, kernel)
        for c in range(heads * head_dim):
            for lag in range(min(kernel, t + 1)):
                want[0, t, c] += x[0, t - lag, c] * (static[lag, c] + dynamic[c // head_dim, lag])
    want = (want + x) / math.sqrt(2 * kernel + 1)
    got = conv(jnp.asarray(x), jnp.asarray(source))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_bfloat16_moe_accumulates_in_float32():
    """Routing weights multiply bf16 expert outputs in fp32 and the sum rounds once."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(8, 16)), jnp.bfloat16)
    gate_up = jnp.asarray(rng.normal(size=(4, 12, 16)), jnp.bfloat16)
    down = jnp.asarray(rng.normal(size=(4, 16, 6)), jnp.bfloat16)
    chosen = jnp.asarray(np.stack([rng.permutation(4)[:2] for _ in range(8)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.5, 1.5, size=(8, 2)), jnp.float32)
    got = moe_experts(x, gate_up, down, chosen, weights, gate_cap=4.0, up_cap=25.0)
    f32 = moe_experts(
        x.astype(jnp.float32),
        gate_up.astype(jnp.float32),
        down.astype(jnp.float32),
        chosen,
        weights,
        gate_cap=4.0,
        up_cap=25.0,
    )
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(f32), rtol=5e-2, atol=5e-2)
    assert jax.numpy.any(got != 0)
