"""Parameter gradients accumulate as torch.nn's do, for every module of :mod:`module_cases` (and a
layer with ``checkpoint_every``) on every backend: two backward passes before an optimizer step
(gradient accumulation, or a retained graph backwarded twice) give twice one pass's gradient, no
two parameters' ``.grad`` share memory, and an in-place clip of the gradients
(``torch.nn.utils.clip_grad_norm_``) scales each once.

Before, the LSTM engines (C and Triton) summed b_ih and b_hh after stacking the directions. Each bias
then got a view of the sum's one gradient, and torch's AccumulateGrad keeps such a view as ``.grad``
without a copy (pytorch issue 34082). So b_ih.grad and b_hh.grad were the same memory: a second
backward added to both twice (3x one pass's gradient instead of 2x), and a clip scaled both twice."""

from __future__ import annotations

import itertools

import pytest
import torch

import fastlayers
from module_cases import CASES, _rnn_case, flat, weighted_sum

BACKENDS = ["cpu", "reference", "triton"]  # triton: CPU tensors under the interpreter (tests/conftest.py)
ALL = [c for c in [*CASES, _rnn_case("LSTM-layer_norm-checkpoint_every", fastlayers.LSTM, torch.nn.LSTM,
                                     bidirectional=True, layer_norm=True, checkpoint_every=2)]
       if any(True for _ in c.build().parameters())]  # (dot-product attention pooling has none)


def _loss(module, args, kwargs) -> torch.Tensor:
    """A weighted sum of every output and final state of one call; the same masks in every call
    (the seed set first) for the modules that draw them in training."""
    torch.manual_seed(1)
    outs = flat(module(*args, **kwargs))
    return weighted_sum(outs)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of ``a`` and ``b`` overlaps (the bytes each spans in its storage)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t):
        start = t.storage_offset() * t.element_size()
        return start, start + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _assert_twice(module, once: dict[str, torch.Tensor]) -> None:
    for n, p in module.named_parameters():
        torch.testing.assert_close(p.grad, 2 * once[n], msg=n)


# Under the interpreter a recurrent case takes 10-85 s (four forwards, five backwards): the Triton engine
# runs the cases whose parameters and paths cover the single-option ones ("-all" has every option's
# parameters and masks, "-layer_norm-checkpoint_every" the segments' backward), the C engine and the
# reference every case.
COVERED = {"LSTM-layer_norm", "LSTM-peephole", "LSTM-cell_clip", "LSTM-zoneout", "LSTM-recurrent_dropout",
           "LSTM-checkpoint_every", "GRU-layer_norm", "GRU-zoneout"}
assert COVERED <= {c.id for c in ALL}
PAIRS = [(c, b) for c in ALL for b in BACKENDS if not (b == "triton" and c.id in COVERED)]


@pytest.mark.parametrize(("case", "backend"), PAIRS, ids=[f"{c.id}-{b}" for c, b in PAIRS])
def test_gradients_accumulate_and_clip_as_torch_nns(case, backend):
    dtype = torch.float32 if backend == "triton" else torch.float64
    torch.manual_seed(0)
    module = case.build(dtype=dtype).train()
    args, kwargs = case.inputs(dtype)
    with fastlayers.backend(backend):
        _loss(module, args, kwargs).backward()
        once = {n: p.grad.clone() for n, p in module.named_parameters()}
        grads = [(n, p.grad) for n, p in module.named_parameters()]
        shared = [(a, b) for (a, ga), (b, gb) in itertools.combinations(grads, 2) if _overlap(ga, gb)]
        assert not shared, f"parameters whose .grad share memory: {shared}"

        # an in-place clip scales each gradient once (as after torch.nn's backward)
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in once.values()]))
        torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm=0.5 * total.item())
        for n, p in module.named_parameters():
            torch.testing.assert_close(p.grad, once[n] * (0.5 * total / (total + 1e-6)), msg=n)

        # two passes: two forwards (gradient accumulation), then one graph retained and backwarded twice
        module.zero_grad(set_to_none=True)
        _loss(module, args, kwargs).backward()
        _loss(module, args, kwargs).backward()
        _assert_twice(module, once)
        module.zero_grad(set_to_none=True)
        loss = _loss(module, args, kwargs)
        loss.backward(retain_graph=True)
        loss.backward()
        _assert_twice(module, once)
