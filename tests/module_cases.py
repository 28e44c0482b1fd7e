"""Every public module with every option, as constructed, plus inputs and the documented init rule.

One :class:`Case` per configuration; the module-contract, repeatability and non-finite-input
tests are parametrised over :data:`CASES`. Sizes are small but large enough for both threads of
the C kernels to get work (D * B step tasks, two or more blocks of output rows).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

import fastlayers

F_IN, HIDDEN, STEPS, BATCH = 8, 16, 9, 5
LENGTHS = [9, 4, 7, 1, 9]  # unsorted, a length 1, two full-length sequences


@dataclass
class Case:
    """build(**factory_kwargs) -> module; inputs(dtype) -> (args, kwargs) of one forward call;
    init(name, module) -> ("uniform", bound) or ("const", value), the documented rule;
    counterpart(**factory_kwargs) -> the torch.nn module taking the same state_dict (None: none)."""

    id: str
    build: Callable[..., nn.Module]
    inputs: Callable[[torch.dtype], tuple[tuple, dict]]
    init: Callable[[str, nn.Module], tuple[str, float]]
    repr_has: tuple[str, ...]
    counterpart: Callable[..., nn.Module] | None = None
    stochastic: bool = False  # train mode draws random masks
    extra: dict[str, Any] = field(default_factory=dict)


def _gen(seed: int = 1) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, g: torch.Generator, dtype: torch.dtype) -> Tensor:
    """float32 normal draws cast to dtype: the same values in every dtype."""
    return torch.randn(shape, generator=g).to(dtype)


def _rnn_init(name: str, module: nn.Module) -> tuple[str, float]:
    if name.startswith("ln_cell_bias"):
        return ("const", 0.0)
    if name.startswith("ln_"):
        return ("const", 1.0)
    return ("uniform", 1 / math.sqrt(module.hidden_size))


def _rnn_inputs(batch_first: bool, lengths: bool):
    def make(dtype: torch.dtype):
        shape = (BATCH, STEPS, F_IN) if batch_first else (STEPS, BATCH, F_IN)
        x = _randn(*shape, g=_gen(), dtype=dtype)
        return (x,), ({"lengths": torch.tensor(LENGTHS)} if lengths else {})
    return make


def _rnn_case(id, cls, torch_cls, *, lengths=True, stochastic=False, repr_has=(), **kwargs) -> Case:
    options = {k: v for k, v in kwargs.items() if k in ("layer_norm", "peephole", "cell_clip", "zoneout",
                                                          "recurrent_dropout", "proj_clip", "checkpoint_every")}
    base = {k: v for k, v in kwargs.items() if k not in options}

    def build(**factory):
        return cls(F_IN, HIDDEN, **kwargs, **factory)

    def counterpart(**factory):
        return torch_cls(F_IN, HIDDEN, **base, **factory)

    return Case(id, build, _rnn_inputs(kwargs.get("batch_first", False), lengths), _rnn_init,
                (cls.__name__ + "(", *repr_has), counterpart, stochastic or kwargs.get("dropout", 0) > 0)


def _local_init(name: str, module: nn.Module) -> tuple[str, float]:
    return ("uniform", 1 / math.sqrt(module.in_channels * math.prod(module.kernel_size)))


def _attention_init(name: str, module: nn.Module) -> tuple[str, float]:
    fan_in = {"weight_query": module.query_size, "weight_key": module.key_size, "v": module.v.numel(),
              "bias": module.key_size}[name]
    return ("uniform", 1 / math.sqrt(fan_in))


def _attention_inputs(dq: int, dk: int, dv: int):
    def make(dtype: torch.dtype):
        g = _gen()
        q = _randn(BATCH, dq, g=g, dtype=dtype)
        k = _randn(BATCH, STEPS, dk, g=g, dtype=dtype)
        v = _randn(BATCH, STEPS, dv, g=g, dtype=dtype)
        return (q, k, v), {"lengths": torch.tensor(LENGTHS)}
    return make


LSTM, GRU, RNN = fastlayers.LSTM, fastlayers.GRU, fastlayers.RNN


def _cell_case(id, cls, torch_cls, *, stochastic=False, repr_has=(), counterpart=True, unbatched=False,
               zero_state=False, **kwargs):
    """A cell module: one step on (B, F) input (or unbatched (F,)) from a random state given as hx
    (h, or (h, c) for LSTMCell; with weight_hh's and the peepholes' gradients zero from the zero
    state, a wrong one would pass), or from the zero state (hx left out)."""
    base = {k: v for k, v in kwargs.items() if k in ("bias", "nonlinearity")}

    def inputs(dtype):
        g = _gen()
        x = _randn(BATCH, F_IN, g=g, dtype=dtype)
        h = _randn(BATCH, kwargs.get("proj_size") or HIDDEN, g=g, dtype=dtype)
        state = (h, _randn(BATCH, HIDDEN, g=g, dtype=dtype)) if issubclass(cls, fastlayers.LSTMCell) else h
        if unbatched:
            x, state = x[0], tree_map(lambda t: t[0], state)
        return ((x,) if zero_state else (x, state)), {}

    return Case(id, lambda **f: cls(F_IN, HIDDEN, **kwargs, **f), inputs, _rnn_init, (cls.__name__ + "(", *repr_has),
                (lambda **f: torch_cls(F_IN, HIDDEN, **base, **f)) if counterpart else None, stochastic)


CELL_CASES: list[Case] = [
    _cell_case("LSTMCell", fastlayers.LSTMCell, nn.LSTMCell),
    _cell_case("LSTMCell-unbatched-nobias", fastlayers.LSTMCell, nn.LSTMCell, unbatched=True, bias=False,
               repr_has=("bias=False",)),
    _cell_case("LSTMCell-zero_state", fastlayers.LSTMCell, nn.LSTMCell, zero_state=True),
    _cell_case("LSTMCell-all+proj", fastlayers.LSTMCell, nn.LSTMCell, counterpart=False, proj_size=5, layer_norm=True,
               peephole=True, cell_clip=1.5, zoneout=(0.2, 0.1), proj_clip=0.7, stochastic=True,
               repr_has=("proj_size=5", "layer_norm=True", "peephole=True", "proj_clip=0.7")),
    _cell_case("GRUCell", fastlayers.GRUCell, nn.GRUCell),
    _cell_case("GRUCell-unbatched-zero_state", fastlayers.GRUCell, nn.GRUCell, unbatched=True, zero_state=True),
    _cell_case("GRUCell-layer_norm-zoneout", fastlayers.GRUCell, nn.GRUCell, layer_norm=True, zoneout=0.2,
               stochastic=True, repr_has=("layer_norm=True", "zoneout=0.2")),
    _cell_case("RNNCell-relu", fastlayers.RNNCell, nn.RNNCell, nonlinearity="relu", repr_has=("nonlinearity=relu",)),
]

CASES: list[Case] = [
    _rnn_case("LSTM", LSTM, nn.LSTM, lengths=False, num_layers=2, bidirectional=True),
    _rnn_case("LSTM-lengths", LSTM, nn.LSTM, num_layers=2, bidirectional=True, dropout=0.25),
    _rnn_case("LSTM-proj", LSTM, nn.LSTM, bidirectional=True, proj_size=5, repr_has=("proj_size=5",)),
    _rnn_case("LSTM-layer_norm", LSTM, nn.LSTM, bidirectional=True, layer_norm=True, repr_has=("layer_norm=True",)),
    _rnn_case("LSTM-peephole", LSTM, nn.LSTM, num_layers=2, peephole=True, batch_first=True,
              repr_has=("peephole=True",)),
    _rnn_case("LSTM-cell_clip", LSTM, nn.LSTM, bidirectional=True, cell_clip=0.5, repr_has=("cell_clip=0.5",)),
    _rnn_case("LSTM-zoneout", LSTM, nn.LSTM, bidirectional=True, zoneout=(0.2, 0.1), stochastic=True,
              repr_has=("zoneout=(0.2, 0.1)",)),
    _rnn_case("LSTM-recurrent_dropout", LSTM, nn.LSTM, bidirectional=True, recurrent_dropout=0.3, stochastic=True,
              repr_has=("recurrent_dropout=0.3",)),
    _rnn_case("LSTM-all+proj", LSTM, nn.LSTM, num_layers=2, bidirectional=True, proj_size=6, layer_norm=True,
              peephole=True, cell_clip=1.5, zoneout=0.1, recurrent_dropout=0.2, proj_clip=0.7, stochastic=True,
              repr_has=("layer_norm=True", "peephole=True", "proj_clip=0.7")),
    _rnn_case("LSTM-checkpoint_every", LSTM, nn.LSTM, bidirectional=True, checkpoint_every=2,
              repr_has=("checkpoint_every=2",)),
    _rnn_case("GRU", GRU, nn.GRU, lengths=False, bidirectional=True),
    _rnn_case("GRU-lengths", GRU, nn.GRU, num_layers=2, bidirectional=True),
    _rnn_case("GRU-layer_norm", GRU, nn.GRU, bidirectional=True, layer_norm=True, repr_has=("layer_norm=True",)),
    _rnn_case("GRU-zoneout", GRU, nn.GRU, bidirectional=True, zoneout=0.2, stochastic=True, repr_has=("zoneout=0.2",)),
    _rnn_case("GRU-all", GRU, nn.GRU, num_layers=2, bidirectional=True, layer_norm=True, zoneout=0.1,
              recurrent_dropout=0.2, batch_first=True, stochastic=True,
              repr_has=("layer_norm=True", "recurrent_dropout=0.2")),
    _rnn_case("RNN_TANH-lengths", RNN, nn.RNN, bidirectional=True),
    _rnn_case("RNN_RELU", RNN, nn.RNN, lengths=False, num_layers=2, nonlinearity="relu", repr_has=("nonlinearity='relu'",)),
    Case("LocallyConnected2d",
         lambda **f: fastlayers.LocallyConnected2d(3, 4, (12, 10), 3, stride=(1, 2), padding=1, **f),
         lambda dtype: ((_randn(2, 3, 12, 10, g=_gen(), dtype=dtype),), {}),
         _local_init, ("LocallyConnected2d(", "kernel_size=(3, 3)", "stride=(1, 2)")),
    Case("LocallyConnected2d-wide",  # vector tiles and streaming-free large rows of the C kernel
         lambda **f: fastlayers.LocallyConnected2d(2, 3, (6, 70), 1, bias=False, **f),
         lambda dtype: ((_randn(3, 2, 6, 70, g=_gen(), dtype=dtype),), {}),
         _local_init, ("bias=False",)),
    Case("LocallyConnected2d-same",  # padding="same" with an even kernel: its extra row / column after the input
         lambda **f: fastlayers.LocallyConnected2d(3, 2, (7, 6), (2, 3), padding="same", dilation=(1, 2), **f),
         lambda dtype: ((_randn(2, 3, 7, 6, g=_gen(), dtype=dtype),), {}),
         _local_init, ("padding=same",)),
    Case("LocallyConnected1d",
         lambda **f: fastlayers.LocallyConnected1d(3, 2, 20, 3, dilation=2, **f),
         lambda dtype: ((_randn(4, 3, 20, g=_gen(), dtype=dtype),), {}),
         _local_init, ("LocallyConnected1d(", "dilation=(2,)")),
    Case("AttentionPooling-dot", lambda **f: fastlayers.AttentionPooling(6, **f), _attention_inputs(6, 6, 4),
         _attention_init, ("score='dot'",)),
    Case("AttentionPooling-scaled_dot", lambda **f: fastlayers.AttentionPooling(6, score="scaled_dot", **f),
         _attention_inputs(6, 6, 4), _attention_init, ("score='scaled_dot'",)),
    Case("AttentionPooling-additive",
         lambda **f: fastlayers.AttentionPooling(6, 5, score="additive", attention_size=48, **f),
         _attention_inputs(6, 5, 3), _attention_init, ("score='additive'",)),
    Case("AttentionPooling-additive-nobias",
         lambda **f: fastlayers.AttentionPooling(4, score="additive", bias=False, **f),
         _attention_inputs(4, 4, 3), _attention_init, ("score='additive'",)),
    *CELL_CASES,
]
CASE_IDS = [c.id for c in CASES]
BY_ID = {c.id: c for c in CASES}


def flat(value: Any) -> list[Tensor]:
    """The tensors of a forward result, in order: output, then states / weights."""
    if isinstance(value, Tensor):
        return [value]
    return [t for v in value for t in flat(v)]


def leaves_like(args: tuple, fn: Callable[[Tensor], Tensor]) -> tuple:
    """args with fn applied to every tensor (a cell's state is a tensor or an (h, c) tuple)."""
    return tree_map(fn, args)


def weighted_sum(outs: list[Tensor]) -> Tensor:
    """A loss that weighs every element of every tensor differently (a ramp from -1 to 1 in each),
    so that a gradient sent to the wrong element or tensor shows."""
    return sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum() for o in outs)


def run(module: nn.Module, case: Case, dtype: torch.dtype = torch.float32, backward: bool = True,
        inputs: tuple[tuple, dict] | None = None) -> tuple[list[Tensor], dict[str, Tensor]]:
    """One forward (and backward with fixed cotangents): outputs, and the gradients of every input
    and parameter (None where a tensor got none)."""
    args, kwargs = inputs if inputs is not None else case.inputs(dtype)
    args = leaves_like(args, lambda a: a.detach().clone().requires_grad_(backward))
    module.zero_grad(set_to_none=True)
    outs = flat(module(*args, **kwargs))
    grads: dict[str, Tensor] = {}
    if backward:
        g = _gen(7)
        loss = sum((o * _randn(*o.shape, g=g, dtype=o.dtype)).sum() for o in outs)
        loss.backward()
        grads = {f"input{i}": a.grad for i, a in enumerate(flat(args))}
        grads.update({n: p.grad for n, p in module.named_parameters()})
    return [o.detach() for o in outs], grads


def digest(case: Case, seed: int = 0) -> str:
    """sha256 of every byte of the outputs and gradients of one seeded construction + training-mode
    forward/backward (the repeatability tests compare it within and across processes)."""
    torch.manual_seed(seed)
    module = case.build()
    module.train()
    torch.manual_seed(seed + 1)
    outs, grads = run(module, case)
    h = hashlib.sha256()
    for t in [*outs, *(grads[k] for k in sorted(grads))]:
        h.update(t.contiguous().numpy().tobytes() if t is not None else b"none")
    return h.hexdigest()


if __name__ == "__main__":  # the cross-process half of test_repeatability: print every digest as JSON
    import json
    import sys

    torch.set_num_threads(int(sys.argv[1]))
    print(json.dumps({c.id: digest(c) for c in CASES}))
