"""float64 gradcheck of the lengths path w.r.t. input, hx and every parameter."""

import pytest
import torch
from torch.func import functional_call

from rnn_helpers import MODES, make_hx, make_pair


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("batch_first", [False, True])
def test_gradcheck_float64(mode, batch_first):
    torch.manual_seed(0)
    ours, _ = make_pair(mode, 3, 4, dtype=torch.float64, num_layers=2, bidirectional=True, batch_first=batch_first)
    names = [n for n, _ in ours.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for p in ours.parameters()]
    x = torch.randn((3, 4, 3) if batch_first else (4, 3, 3), dtype=torch.float64, requires_grad=True)
    hx = make_hx(ours, 3, dtype=torch.float64)
    states = [s.requires_grad_(True) for s in (hx if isinstance(hx, tuple) else (hx,))]
    lengths = torch.tensor([2, 4, 1])

    def f(x, *rest):
        st, ps = rest[: len(states)], rest[len(states):]
        h = tuple(st) if len(st) == 2 else st[0]
        out, hn = functional_call(ours, dict(zip(names, ps)), (x, h), {"lengths": lengths})
        hn = hn if isinstance(hn, tuple) else (hn,)
        return (out, *hn)

    assert torch.autograd.gradcheck(f, (x, *states, *params), eps=1e-6, atol=1e-5, rtol=1e-4)
