"""attention_pool / AttentionPooling against a naive float64 loop; gradcheck; masking; errors."""

import math

import pytest
import torch
from hypothesis import given, strategies as st

from fastlayers import AttentionPooling, attention_pool


def naive(query, keys, values, lengths, score, additive=None):
    """Per-sequence, per-step float64 loop, written independently of the batched version."""
    batch, steps = keys.shape[:2]
    contexts, weights = [], []
    for b in range(batch):
        n = steps if lengths is None else int(lengths[b])
        e = []
        for t in range(n):
            if score == "additive":
                w_q, w_k, v, bias = additive
                pre = w_q @ query[b] + w_k @ keys[b, t] + (bias if bias is not None else 0)
                e.append(torch.dot(v, torch.tanh(pre)))
            else:
                s = torch.dot(query[b], keys[b, t])
                e.append(s / math.sqrt(keys.size(2)) if score == "scaled_dot" else s)
        e = torch.stack(e)
        a = torch.exp(e - e.max())
        a = a / a.sum()
        ctx = sum(a[t] * values[b, t] for t in range(n))
        contexts.append(ctx)
        weights.append(torch.cat([a, a.new_zeros(steps - n)]))
    return torch.stack(contexts), torch.stack(weights)


def _make(score, batch=3, steps=5, dq=4, dk=4, dv=6, attention=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, dq, generator=g, dtype=dtype)
    k = torch.randn(batch, steps, dk, generator=g, dtype=dtype)
    v = torch.randn(batch, steps, dv, generator=g, dtype=dtype)
    add = None
    if score == "additive":
        add = (torch.randn(attention, dq, generator=g, dtype=dtype), torch.randn(attention, dk, generator=g, dtype=dtype),
               torch.randn(attention, generator=g, dtype=dtype), torch.randn(attention, generator=g, dtype=dtype))
    return q, k, v, add


@pytest.mark.parametrize("score", ["dot", "scaled_dot", "additive"])
@pytest.mark.parametrize("lengths", [None, [5, 1, 3]])
def test_matches_naive_loop(score, lengths):
    q, k, v, add = _make(score, dk=4 if score != "additive" else 7)
    ctx, w = attention_pool(q, k, v, lengths, score=score, additive=add)
    ref_ctx, ref_w = naive(q, k, v, lengths, score, add)
    torch.testing.assert_close(ctx, ref_ctx)
    torch.testing.assert_close(w, ref_w)
    if lengths is not None:
        for b, n in enumerate(lengths):
            assert (w[b, n:] == 0).all()


@pytest.mark.parametrize("score", ["dot", "scaled_dot", "additive"])
def test_gradcheck(score):
    q, k, v, add = _make(score, dk=4 if score != "additive" else 5)
    tensors = [q, k, v] + (list(add) if add else [])
    tensors = [t.requires_grad_(True) for t in tensors]

    def f(q, k, v, *a):
        return attention_pool(q, k, v, [5, 2, 4], score=score, additive=tuple(a) if a else None)

    assert torch.autograd.gradcheck(f, tuple(tensors))


def test_values_default_to_keys_and_module_additive_matches_functional():
    torch.manual_seed(0)
    pool = AttentionPooling(4, 6, score="additive", attention_size=5).double()
    q, k = torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 7, 6, dtype=torch.float64)
    ctx, w = pool(q, k, lengths=torch.tensor([7, 3]))
    ref_ctx, ref_w = naive(q, k, k, [7, 3], "additive", (pool.weight_query, pool.weight_key, pool.v, pool.bias))
    torch.testing.assert_close(ctx, ref_ctx)
    torch.testing.assert_close(w, ref_w)
    grads = torch.autograd.grad(ctx.sum(), list(pool.parameters()))
    assert all(g.abs().sum() > 0 for g in grads)


def test_no_nan_for_huge_scores():
    q = torch.full((2, 3), 1e4)
    k = torch.full((2, 4, 3), 1e4)
    k[0, 1] = -1e4
    q.requires_grad_(True)
    ctx, w = attention_pool(q, k, lengths=[3, 1])
    assert torch.isfinite(ctx).all() and torch.isfinite(w).all()
    ctx.sum().backward()
    assert torch.isfinite(q.grad).all()
    assert w[1, 0] == 1 and (w[1, 1:] == 0).all()


@given(batch=st.integers(1, 4), steps=st.integers(1, 6), dim=st.integers(1, 5), dv=st.integers(1, 4),
       score=st.sampled_from(["dot", "scaled_dot", "additive"]), seed=st.integers(0, 1000), data=st.data())
def test_hypothesis_against_naive(batch, steps, dim, dv, score, seed, data):
    lengths = data.draw(st.lists(st.integers(1, steps), min_size=batch, max_size=batch))
    q, k, v, add = _make(score, batch=batch, steps=steps, dq=dim, dk=dim, dv=dv, seed=seed)
    ctx, w = attention_pool(q, k, v, lengths, score=score, additive=add)
    ref_ctx, ref_w = naive(q, k, v, lengths, score, add)
    torch.testing.assert_close(ctx, ref_ctx)
    torch.testing.assert_close(w, ref_w)


def test_errors():
    q, k, v, _ = _make("dot", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"lengths: every length must be >= 1, got 0"):
        attention_pool(q, k, v, [5, 0, 2])
    with pytest.raises(ValueError, match=r"lengths: every length must be <= T = 5 .* got 6"):
        attention_pool(q, k, v, [5, 6, 2])
    with pytest.raises(ValueError, match=r"lengths: expected 3 lengths .* got 2"):
        attention_pool(q, k, v, [5, 2])
    with pytest.raises(TypeError, match=r"lengths: expected an integer tensor"):
        attention_pool(q, k, v, torch.tensor([5.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match=r"keys: expected a 3-D tensor \(B, T, Dk\), got 2-D"):
        attention_pool(q, k[:, 0], v)
    with pytest.raises(ValueError, match=r"keys: expected feature size Dk = 4 .* got 3"):
        attention_pool(q, k[..., :3], v)
    with pytest.raises(ValueError, match=r"values: expected \(B, T\) = \(3, 5\) .* got \(3, 4\)"):
        attention_pool(q, k, v[:, :4])
    with pytest.raises(ValueError, match=r"score: expected one of"):
        attention_pool(q, k, v, score="cosine")
    with pytest.raises(ValueError, match=r"additive: expected \(weight_query"):
        attention_pool(q, k, v, score="additive")
    with pytest.raises(TypeError, match=r"keys: expected dtype torch.float32 .* got torch.float64"):
        attention_pool(q, k.double(), v)
    with pytest.raises(TypeError, match=r"query: expected a floating-point tensor"):
        attention_pool(q.long(), k, v)
    with pytest.raises(ValueError, match=r"key_size: expected 4 \(= query_size\)"):
        AttentionPooling(4, 5, score="dot")
