"""attention_pool / AttentionPooling against a naive float64 loop; gradcheck; masking; errors; the CPU
binding's own backward (fastlayers.attention._cpu) against the twin's autograd."""

import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st
from torch.autograd import gradcheck, gradgradcheck

import fastlayers
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


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("score", ["dot", "scaled_dot", "additive"])
def test_gradcheck(score, backend):
    """The CPU binding's backwards and the twin's autograd, each against finite differences."""
    q, k, v, add = _make(score, dk=4 if score != "additive" else 5)
    tensors = [q, k, v] + (list(add) if add else [])
    tensors = [t.requires_grad_(True) for t in tensors]

    def f(q, k, v, *a):
        with fastlayers.backend(backend):
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


def _grads(score, lengths, tensors, use, backend):
    """(context, weights, their grads in ``tensors`` = (q, k, v) + the additive parameters (None
    where none)) of one call on ``backend``, the outputs weighted by fixed cotangents, only those in
    ``use``."""
    leaves = [t if t is None else t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
    with fastlayers.backend(backend):
        context, weights = attention_pool(*leaves[:3], lengths, score=score,
                                          additive=tuple(leaves[3:]) if score == "additive" else None)
    if context.requires_grad:  # the binding ran, or the twin
        name = "AdditiveCPUBackward" if score == "additive" else "AttentionCPUBackward"
        assert (context.grad_fn.name() == name) == (backend == "cpu")
    g = torch.Generator().manual_seed(1)
    pairs = [(o, torch.randn(o.shape, generator=g, dtype=o.dtype)) for o, name in ((context, "context"),
             (weights, "weights")) if name in use and o.requires_grad]
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    grads = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [c for _, c in pairs], allow_unused=True)
                 if pairs else [None] * len(wanted))
    return context, weights, [next(grads) if t is not None and t.requires_grad else None for t in leaves]


def _compare(got, want, lengths, use, **tol):
    """Values and gradients of the binding (``got``) against the twin's (``want``); an input without
    a path to a used output may get None on one side and zeros on the other."""
    torch.testing.assert_close(got[:2], want[:2], **tol)
    for i, (a, b) in enumerate(zip(got[2], want[2])):
        if a is None or b is None or (i == 2 and "context" not in use):
            assert (a is None or not a.any()) and (b is None or not b.any()), i
            continue
        torch.testing.assert_close(a, b, **tol, msg=f"input {i}")
        if lengths is not None and i in (1, 2):  # keys, values: exactly 0 at the padded steps
            for row, n in enumerate(lengths):
                assert not a[row, n:].any(), (i, row)


@pytest.mark.parametrize("score", ["dot", "scaled_dot", "additive"])
@pytest.mark.parametrize("lengths", [None, [5, 1, 3]])
@pytest.mark.parametrize("use", [("context", "weights"), ("context",), ("weights",)])
@pytest.mark.parametrize("needs", [(True, True, True), (True, True, False), (False, True, False), (True, False, True),
                                   (False, False, False)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cpu_binding_equals_the_twin(score, lengths, use, needs, dtype):
    """Default CPU calls run AttentionCPU / AdditiveCPU (their own backwards); the same values and
    gradients as the twin's autograd (forced "reference"), for subsets of the inputs requiring grad
    (the additive parameters always, or alone; for dot scores none: the forward without an autograd
    node) and of the outputs used; padded steps' gradients 0."""
    q, k, v, add = _make(score, dk=4 if score != "additive" else 7, dtype=dtype)
    tensors = [t.requires_grad_(n) for t, n in zip((q, k, v), needs)]
    if add:
        tensors += [t.requires_grad_(True) for t in add]
    got = _grads(score, lengths, tensors, use, "cpu")
    want = _grads(score, lengths, tensors, use, "reference")
    _compare(got, want, lengths, use, **({} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 2e-6}))


def test_cpu_binding_additive_without_bias_and_module_as_constructed():
    """AttentionPooling(score="additive") as constructed (float32, its own initialisation), with and
    without bias: the binding's values and every parameter's gradient equal the twin's."""
    torch.manual_seed(0)
    for bias in (True, False):
        pool = AttentionPooling(6, 5, score="additive", attention_size=4, bias=bias)
        q, k = torch.randn(3, 6, requires_grad=True), torch.randn(3, 7, 5, requires_grad=True)
        results = []
        for backend in ("cpu", "reference"):
            with fastlayers.backend(backend):
                context, weights = pool(q, k, lengths=[7, 2, 5])
            assert (context.grad_fn.name() == "AdditiveCPUBackward") == (backend == "cpu")
            results.append((context, weights, torch.autograd.grad(context.square().sum() + weights[:, 1].sum(),
                                                                  [q, k, *pool.parameters()])))
        torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=2e-6)
        assert len(results[0][2]) == 5 + bias


def test_cpu_binding_padded_steps_get_zero_key_gradients_whatever_the_values_hold():
    """As the twin's masked_fill: a NaN value at a padded step makes that sequence's context NaN
    (weight 0 times NaN, documented), the keys' gradient there stays exactly 0 on both paths, and
    the valid steps' gradient is what the weights' gradient gives (the padded step's dC . v_t is
    kept out of softmax's row sum)."""
    q, k, v, _ = _make("dot")
    v[1, 3] = float("nan")
    for backend in ("cpu", "reference"):
        kk = k.clone().requires_grad_(True)
        with fastlayers.backend(backend):
            context, weights = attention_pool(q, kk, v, [5, 1, 3])
            assert (context.grad_fn.name() == "AttentionCPUBackward") == (backend == "cpu")
        dk = torch.autograd.grad(weights.sum() + context.sum(), kk)[0]
        assert context[1].isnan().all() and not dk[1].any(), backend  # (one valid step: its score's gradient is 0)
        assert dk[[0, 2]].isfinite().all(), backend


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("score", ["dot", "scaled_dot", "additive"])
@pytest.mark.parametrize("where,dtype,big", [("values", torch.float32, 1e38), ("keys", torch.float32, 1e30),
                                             ("values", torch.float64, 1e308), ("keys", torch.float64, 1e200)])
def test_large_finite_padding_changes_no_result_or_gradient(backend, score, where, dtype, big):
    """Finite values at the padded steps, however large: the padded values' dC . v_t (inf) reached
    softmax's row sum as 0 * inf, so every gradient of the sequence was NaN. Now equal to the call
    on the steps kept (keys whose additive projection overflows excepted: documented)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, dtype=dtype), torch.randn(2, 3, 4, dtype=dtype), torch.randn(2, 3, 5, dtype=dtype)
    if where == "values":
        v[0, 2] = big  # (dC . v_t overflows: 5 big of one sign)
    else:
        k[0, 2] = big * torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=dtype)
    add = tuple(torch.randn(*s, dtype=dtype) for s in ((6, 4), (6, 4), (6,), (6,))) if score == "additive" else None
    inputs = [t.requires_grad_() for t in (q, k, v, *(add or ()))]

    def grads(query, keys, values, lengths):
        with fastlayers.backend(backend):
            context, weights = attention_pool(query, keys, values, lengths, score=score, additive=add)
        return context, weights, torch.autograd.grad(context.sum() + (weights * torch.arange(weights.size(1))).sum(),
                                                     inputs, allow_unused=True)

    context, weights, got = grads(q, k, v, [2, 3])
    want_context, want_weights, want = grads(q[:1], k[:1, :2], v[:1, :2], None)  # sequence 0 without its padded step
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(context[0], want_context[0], **tol)
    assert weights[0, 2] == 0
    torch.testing.assert_close(weights[0, :2], want_weights[0], **tol)
    gq, gk, gv, *gadd = got
    assert gk[0, 2].eq(0).all() and gv[0, 2].eq(0).all()
    for a, b in ((gq[0], want[0][0]), (gk[0, :2], want[1][0, :2]), (gv[0, :2], want[2][0, :2])):
        torch.testing.assert_close(a, b, **tol)
    assert all(g.isfinite().all() for g in gadd)


@pytest.mark.parametrize("backend", ["cpu", "triton", "reference"])
@pytest.mark.parametrize("score", ["dot", "additive"])
def test_weights_need_no_gradient_when_only_the_values_do(backend, score):
    """The weights are a function of query and keys (and the additive parameters): with only the
    values requiring a gradient they require none, as the twin's and torch's (the CPU binding's
    had a grad_fn, so weights.sum().backward() did nothing silently where the twin's raises)."""
    q, k, v, add = _make(score)
    v = v.requires_grad_()
    with fastlayers.backend(backend):
        context, weights = attention_pool(q, k, v, [5, 1, 3], score=score, additive=add)
    if backend == "triton" and score == "dot":
        assert context.grad_fn.name() == "AttentionTritonBackward"
    assert context.requires_grad and not weights.requires_grad and weights.grad_fn is None


@pytest.mark.parametrize("score", ["dot", "scaled_dot", "additive"])
def test_cpu_binding_gradgradcheck(score):
    """A recorded backward (create_graph) differentiates the twin: second derivatives, not zeros."""
    q, k, v, add = _make(score, batch=2, steps=4, dq=3, dk=3, dv=2, attention=2)
    inputs = tuple(t.requires_grad_(True) for t in (q, k, v) + (add or ()))
    name = "AdditiveCPUBackward" if score == "additive" else "AttentionCPUBackward"

    def f(q, k, v, *params):
        context, weights = attention_pool(q, k, v, [4, 2], score=score, additive=params or None)
        assert context.grad_fn.name() == name
        return context, weights

    assert gradcheck(f, inputs) and gradgradcheck(f, inputs)


def test_cpu_binding_under_torch_func_runs_the_twin():
    """torch.func transforms (which an autograd.Function without setup_context refuses) run the twin:
    grad and vmap give the twin's answers."""
    q, k, v, _ = _make("dot")

    def loss(q, k):
        context, weights = attention_pool(q, k, v, [5, 1, 3])
        return context.sum() + (weights ** 2).sum()

    dq, dk = torch.func.grad(loss, argnums=(0, 1))(q, k)
    with fastlayers.backend("reference"):
        want = torch.autograd.grad(loss(q.requires_grad_(True), k.requires_grad_(True)), (q, k))
    torch.testing.assert_close((dq, dk), want)
    batched = torch.func.vmap(lambda qq, kk: attention_pool(qq, kk, v)[0])(q.detach().expand(2, -1, -1),
                                                                            k.detach().expand(2, -1, -1, -1))
    torch.testing.assert_close(batched[1], attention_pool(q.detach(), k.detach(), v)[0])


@given(batch=st.integers(0, 4), steps=st.integers(1, 6), dim=st.integers(1, 5), dv=st.integers(1, 4),
       attention=st.integers(1, 4), score=st.sampled_from(["dot", "scaled_dot", "additive"]), seed=st.integers(0, 1000),
       data=st.data())
def test_hypothesis_cpu_binding_gradients_equal_the_twin(batch, steps, dim, dv, attention, score, seed, data):
    lengths = data.draw(st.one_of(st.none(), st.lists(st.integers(1, steps), min_size=batch, max_size=batch)))
    use = data.draw(st.sampled_from([("context", "weights"), ("context",), ("weights",)]))
    q, k, v, add = _make(score, batch=batch, steps=steps, dq=dim, dk=data.draw(st.integers(1, 5)) if score == "additive"
                         else dim, dv=dv, attention=attention, seed=seed)
    tensors = [q, k, v] + list(add or ())
    if add and data.draw(st.booleans()):
        tensors[-1] = None  # no bias
    needs = data.draw(st.lists(st.booleans(), min_size=len(tensors), max_size=len(tensors)).filter(any))
    tensors = [t if t is None else t.requires_grad_(n) for t, n in zip(tensors, needs)]
    _compare(_grads(score, lengths, tensors, use, "cpu"), _grads(score, lengths, tensors, use, "reference"), lengths,
             use)


@pytest.mark.parametrize("score", ["dot", "scaled_dot"])
def test_cpu_binding_values_default_to_keys(score):
    """values = keys (the default): one tensor in both roles gets the sum of both gradients."""
    q, k, _, _ = _make(score)
    grads = []
    for backend in ("cpu", "reference"):
        leaves = (q.clone().requires_grad_(True), k.clone().requires_grad_(True))
        with fastlayers.backend(backend):
            context, weights = attention_pool(*leaves, lengths=[5, 1, 3], score=score)
        grads.append(torch.autograd.grad((context ** 2).sum() + weights[:, 0].sum(), leaves))
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("backend", ["cpu", "triton", "reference"])
def test_additive_parameter_errors_name_the_argument(backend):
    """The additive tuple is checked whole, on every backend alike: each element's type, shape
    (A from weight_query; the query's and keys' sizes named where theirs differ), device, and dtype
    outside autocast (a wrong v was blamed on weight_query, a bias of another shape gave torch's
    broadcast error or broadcast silently, a (A, 1) v ran on one backend only, float64 parameters
    with float32 inputs ran silently)."""
    import fastlayers

    torch.manual_seed(0)
    q, k = torch.randn(2, 4), torch.randn(2, 3, 5)
    w_q, w_k, v, b = torch.randn(3, 4), torch.randn(3, 5), torch.randn(3), torch.randn(3)
    bad = [
        ((w_q, w_k, torch.randn(4), b), ValueError, r"additive v: expected shape \(3,\) \(A,\), got \(4,\)"),
        ((w_q, w_k, v[:, None], b), ValueError, r"additive v: expected shape \(3,\) \(A,\), got \(3, 1\)"),
        ((w_q, w_k, v, torch.randn(5)), ValueError, r"additive bias: expected shape \(3,\) \(A,\), got \(5,\)"),
        ((w_q, w_k, v, torch.randn(1, 3)), ValueError, r"additive bias: expected shape \(3,\) \(A,\), got \(1, 3\)"),
        ((w_q, w_k, v, torch.tensor(1.0)), ValueError, r"additive bias: expected shape \(3,\) \(A,\), got \(\)"),
        ((w_q, w_k[:2], v, b), ValueError, r"additive weight_key: expected shape \(3, 5\) \(A, Dk\), got \(2, 5\)"),
        ((w_q[:, :3], w_k, v, b), ValueError, r"query: expected feature size Dq = 3 \(additive weight_query's"),
        ((w_q, w_k[:, :4], v, b), ValueError, r"keys: expected feature size Dk = 4 \(additive weight_key's"),
        ((w_q.double(), w_k, v, b), TypeError, r"additive weight_query: expected dtype torch.float32 \(that of "
                                               r"query\), got torch.float64"),
        ((w_q, w_k, v, b.double()), TypeError, r"additive bias: expected dtype torch.float32"),
        ((w_q, w_k, v), TypeError, r"additive: expected a tuple \(weight_query, weight_key, v, bias or None\), got "
                                   r"a tuple of 3"),
        ((w_q.numpy(), w_k, v, b), TypeError, r"additive weight_query: expected a torch.Tensor, got ndarray"),
    ]
    with fastlayers.backend(backend):
        for additive, error, message in bad:
            with pytest.raises(error, match=message):
                attention_pool(q, k, score="additive", additive=additive)
        with pytest.raises(ValueError, match=r"additive: expected None for score='dot'"):
            attention_pool(q, torch.randn(2, 3, 4), score="dot", additive=(w_q, w_k, v, b))
        with torch.autocast("cpu", torch.bfloat16):  # (the products take autocast's dtype: parameters of any)
            context, weights = attention_pool(q, k, score="additive", additive=(w_q.double(), w_k, v, b))
        assert context.dtype == weights.dtype == torch.bfloat16


def test_module_sizes_are_checked():
    for kwargs, message in ((dict(attention_size=0), "attention_size: expected a positive int or None, got 0"),
                            (dict(attention_size=-1), "attention_size: expected a positive int or None, got -1"),
                            (dict(attention_size=2.5), "attention_size: expected a positive int or None, got 2.5"),
                            (dict(attention_size=True), "attention_size: expected a positive int or None, got True")):
        with pytest.raises(ValueError, match=re.escape(message)):
            AttentionPooling(4, score="additive", **kwargs)
    with pytest.raises(ValueError, match=re.escape("query_size: expected a positive int, got True")):
        AttentionPooling(True)
    assert AttentionPooling(4, score="additive", attention_size=7).v.shape == (7,)
    # NumPy's integers, as nn.Linear takes them (they were refused: "expected a positive int, got np.int64(4)")
    m = AttentionPooling(np.int64(4), np.int32(3), score="additive", attention_size=np.int64(5))
    assert (m.query_size, m.key_size, m.weight_query.shape, m.v.shape) == (4, 3, (5, 4), (5,))
    assert type(m.query_size) is int and "query_size=4" in repr(m)


def test_varlen_query_batch_is_named_against_cu_seqlens():
    with pytest.raises(ValueError, match=re.escape("query: expected batch size 2 (cu_seqlens' length - 1), got 3")):
        attention_pool(torch.randn(3, 4), torch.randn(10, 4), cu_seqlens=torch.tensor([0, 3, 10]))


def test_repr_names_the_additive_sizes_and_edge_inputs():
    """The repr tells additive modules apart (attention size, no bias); a scaled-dot score of
    Dk = 0 runs as the dot score does (it raised ZeroDivisionError); lengths on the meta device
    are an error naming ``lengths``."""
    assert repr(AttentionPooling(6, 4, score="additive", attention_size=5)) == \
        "AttentionPooling(query_size=6, key_size=4, score='additive', attention_size=5)"
    assert repr(AttentionPooling(6, 4, score="additive", bias=False)).endswith("attention_size=4, bias=False)")
    assert repr(AttentionPooling(4)) == "AttentionPooling(query_size=4, key_size=4, score='dot')"
    q, k = torch.randn(2, 0), torch.randn(2, 3, 0)
    _, dot = fastlayers.attention_pool(q, k, torch.randn(2, 3, 5))
    _, scaled = fastlayers.attention_pool(q, k, torch.randn(2, 3, 5), score="scaled_dot")
    assert torch.equal(dot, scaled) and torch.allclose(dot, torch.full((2, 3), 1 / 3))
    with pytest.raises(ValueError, match=r"lengths: expected a tensor with values .* got a meta tensor"):
        fastlayers.attention_pool(torch.randn(2, 3, device="meta"), torch.randn(2, 4, 3, device="meta"),
                                  lengths=torch.tensor([4, 2], device="meta"))
