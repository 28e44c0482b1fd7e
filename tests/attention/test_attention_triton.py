"""The attention pooling Triton kernels on CPU tensors through Triton's interpreter
(TRITON_INTERPRET=1, set by conftest before any kernel is compiled), forced with
fastlayers.backend("triton"): values and every gradient against a float64 reference, lengths,
values defaulting to keys, the additive score on the torch path.
make test runs this file poisoned under the newest Triton, the tests marked ``each_triton`` also
under Triton 3.6.0."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

import fastlayers  # noqa: E402
from fastlayers.functional import attention_pool  # noqa: E402

from grad_helpers import assert_close_all, grads  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                                reason="no GPU and Triton's interpreter is off")


def _attention_reference(q, k, v, lengths, scale):
    """Plain float64 masked softmax pooling."""
    s = (k.double() * q.double().unsqueeze(1)).sum(-1) * scale
    if lengths is not None:
        s = s.masked_fill(torch.arange(k.size(1)) >= lengths.unsqueeze(1), float("-inf"))
    w = torch.softmax(s, 1)
    return (w.unsqueeze(-1) * v.double()).sum(1), w


@pytest.mark.each_triton
@pytest.mark.parametrize("score", ["dot", "scaled_dot"])
@pytest.mark.parametrize("lengths", [None, [70, 3, 1, 45]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_attention_pool_matches_the_float64_reference(score, lengths, dtype):
    """T = 70 spans two time chunks of the kernel, so the online softmax is exercised."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g, dtype=dtype) for s in ((4, 6), (4, 70, 6), (4, 70, 5)))
    lens = torch.tensor(lengths) if lengths is not None else None
    scale = 1 / math.sqrt(6) if score == "scaled_dot" else 1.0
    with fastlayers.backend("triton"):
        got = grads(lambda q, k, v: attention_pool(q, k, v, lens, score=score), q, k, v)
    want = grads(lambda q, k, v: _attention_reference(q, k, v, lens, scale), q.double(), k.double(), v.double())
    assert_close_all(got, want, 1e-5 if dtype == torch.float32 else 1e-10)


@pytest.mark.parametrize("score", ["dot", "scaled_dot"])
def test_attention_lengths_given_as_a_strided_view(score):
    """lengths as a view with stride 2 (t[:, 0]): the kernel read them as contiguous (NaN out)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((3, 4), (3, 5, 4), (3, 5, 2)))
    lens = torch.tensor([[5, 0], [2, 0], [3, 0]])[:, 0]
    with fastlayers.backend("triton"):
        got = grads(lambda q, k, v: attention_pool(q, k, v, lens, score=score), q, k, v)
    scale = 1 / math.sqrt(4) if score == "scaled_dot" else 1.0
    want = grads(lambda q, k, v: _attention_reference(q, k, v, lens.contiguous(), scale), q, k, v)
    assert_close_all(got, want, 1e-12)


def test_attention_values_default_to_keys_and_values_without_grad():
    """values=None pools the keys; values that need no gradient (data, as in seed 001) take the
    kernel's NEED_DV=False backward; both on the Triton kernels."""
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(3, 4, generator=g, requires_grad=True), torch.randn(3, 9, 4, generator=g, requires_grad=True)
    v = torch.randn(3, 9, 2, generator=g)  # data, as in seed 001
    with fastlayers.backend("triton"):
        c1, w1 = attention_pool(q, k, lengths=[9, 4, 1])
        c2, _ = attention_pool(q, k, v, lengths=[9, 4, 1])
    assert type(c1.grad_fn).__name__ == type(c2.grad_fn).__name__ == "AttentionTritonBackward"
    r1, rw1 = attention_pool(q, k, lengths=[9, 4, 1])
    r2, _ = attention_pool(q, k, v, lengths=[9, 4, 1])
    torch.testing.assert_close(c1, r1)
    torch.testing.assert_close(w1, rw1)
    got = torch.autograd.grad(c1.sum() + c2.sum() + (w1 * w1).sum(), [q, k])
    want = torch.autograd.grad(r1.sum() + r2.sum() + (rw1 * rw1).sum(), [q, k])
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)


def test_attention_additive_score_uses_the_torch_path_under_triton():
    torch.manual_seed(0)
    pool = fastlayers.AttentionPooling(4, score="additive")
    q, k = torch.randn(2, 4), torch.randn(2, 5, 4)
    with fastlayers.backend("triton"):
        got = pool(q, k, lengths=[5, 2])
    assert type(got[0].grad_fn).__name__ != "AttentionTritonBackward"  # (the parameters need gradients: a graph)
    torch.testing.assert_close(got, pool(q, k, lengths=[5, 2]))


@pytest.mark.parametrize("where", ["values", "keys"])
def test_non_finite_padding_reaches_nothing_on_triton(where):
    """The Triton kernels read no padded step in either pass: a NaN there leaves the context and
    every gradient finite (the backward once read the padded values, so a finite context came with
    NaN gradients) and the padded steps' own gradients exactly 0."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 3, generator=g), torch.randn(2, 4, 3, generator=g), torch.randn(2, 4, 2, generator=g)
    (v if where == "values" else k)[1, 3] = float("nan")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with fastlayers.backend("triton"):
        context, _ = attention_pool(q, k, v, [4, 2])
    gq, gk, gv = torch.autograd.grad(context.sum(), (q, k, v))
    for t in (context, gq, gk, gv):
        assert bool(t.isfinite().all())
    assert bool((gk[1, 2:] == 0).all()) and bool((gv[1, 2:] == 0).all())


def test_a_first_block_of_minus_inf_scores_gives_them_weight_zero():
    """Scores of -inf over the kernel's whole first time block (64 steps), finite after it: those
    steps get weight 0 and the rest their softmax, as torch.softmax (the online softmax subtracted a
    running maximum of -inf from -inf: NaN context and weights). Every score -inf: NaN, as torch's."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((2, 3), (2, 70, 3), (2, 70, 4)))
    k = k.clone()
    k[:, :66, 0] = float("-inf")
    q = q.clone()
    q[:, 0] = 1.0  # (the scores of those steps -inf, the others finite)
    lengths = torch.tensor([70, 66])  # (the second sequence: every valid score -inf)
    with fastlayers.backend("triton"):
        context, weights = attention_pool(q, k, v, lengths)
    want_context, want_weights = _attention_reference(q, k, v, lengths, 1.0)
    assert want_context[0].isfinite().all() and want_context[1].isnan().all()
    torch.testing.assert_close(context, want_context, equal_nan=True)
    torch.testing.assert_close(weights[:, :66], want_weights[:, :66], equal_nan=True)
    torch.testing.assert_close(weights[0], want_weights[0])
    assert torch.equal(weights[0, :66], torch.zeros(66)) and torch.equal(weights[1, 66:], torch.zeros(4))  # (padded: 0)
    with fastlayers.backend("reference"):
        ref_context, ref_weights = attention_pool(q, k, v, lengths)
    torch.testing.assert_close(ref_context, context, equal_nan=True)
    torch.testing.assert_close(ref_weights[:, :66], weights[:, :66], equal_nan=True)
