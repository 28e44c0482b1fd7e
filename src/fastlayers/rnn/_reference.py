"""The recurrent layers' plain-PyTorch twins: the per-step reference of the engine's LSTM / GRU with
cell options (plain torch ops, autograd, no kernels), and :func:`reference_varlen_rnn`, the twin of
:func:`fastlayers.rnn._varlen.varlen_rnn` through torch's PackedSequence path.

Written from the equations (see :class:`fastlayers.rnn._options.CellOptions`), independently of
the engine: original time order, the reverse direction walks t = T-1 .. 0 with a per-sequence
activity mask instead of gathers. Same signatures as :func:`fastlayers.rnn._cpu.lstm_engine` /
``gru_engine``;
the test oracle (run in float64) and the path for devices without the C kernels.

:func:`reference_varlen_rnn` has varlen_rnn's signature and semantics; it is the test oracle on CPU
and the implementation on CUDA, where torch's packed path is cuDNN's own variable-length kernel.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from .._core import precision as _precision, twice
from ._masks import keep_mask
from ._options import CellOptions
from ._varlen import KERNELS

EPS = 1e-5


def _ln(v: Tensor, gain: Tensor, bias: Tensor | None = None) -> Tensor:
    """LayerNorm over the last dimension in v's dtype (float32 for low-precision calls):
    gain * (v - mean) / sqrt(var + eps) + bias, the biased variance (torch's F.layer_norm, one op)."""
    return F.layer_norm(v, (v.size(-1),), gain.to(v.dtype), bias.to(v.dtype) if bias is not None else None, EPS)


def lstm_cell_step(x_t, h, c, p, opt: CellOptions, mm: _precision.Products | None = None):
    """One LSTM step with options (before zoneout): returns (h_new (B, H_out), c_new (B, H)).

    With a projection (``weight_hr`` (P, H) in p, torch's proj_size): h_new = W_hr (o * tanh(.)),
    clipped to [-proj_clip, proj_clip] if set; H_out = P. Matrix products by ``mm`` (default: as
    x_t's dtype and the autocast state say); the rest in their result dtype (float32 when mixed).
    """
    mm = mm or _precision.Products.of(x_t)
    hidden = c.size(-1)
    c = c.to(mm.acc)
    xw = mm.matmul(x_t, p["weight_ih"].T)
    hw = mm.matmul(h, p["weight_hh"].T)
    if opt.layer_norm:
        xw, hw = _ln(xw, p["ln_ih_weight"]), _ln(hw, p["ln_hh_weight"])
    pre = xw + hw
    if "bias_ih" in p:
        pre = pre + p["bias_ih"].to(mm.acc) + p["bias_hh"].to(mm.acc)
    pi, pf, pg, po = pre.split(hidden, dim=-1)
    if opt.peephole:
        wi, wf, wo = p["weight_peephole"].to(mm.acc).split(hidden)
        pi, pf = pi + wi * c, pf + wf * c
    i, f, g = torch.sigmoid(pi), torch.sigmoid(pf), torch.tanh(pg)
    c_new = f * c + i * g
    if opt.cell_clip:
        c_new = c_new.clamp(-opt.cell_clip, opt.cell_clip)
    if opt.peephole:
        po = po + wo * c_new
    o = torch.sigmoid(po)
    n = _ln(c_new, p["ln_cell_weight"], p["ln_cell_bias"]) if opt.layer_norm else c_new
    h_new = o * torch.tanh(n)
    if "weight_hr" in p:
        h_new = mm.matmul(h_new, p["weight_hr"].T)
        if opt.proj_clip:
            h_new = h_new.clamp(-opt.proj_clip, opt.proj_clip)
    return h_new, c_new


def gru_cell_step(x_t, h, p, opt: CellOptions, h_in=None, mm: _precision.Products | None = None):
    """One GRU step with options (before zoneout), torch.nn.GRU's equations: returns h_new (B, H).

    ``h_in`` is the recurrent input (h with recurrent dropout applied); the z * h term uses h.
    With layer_norm (haste's LayerNormGRU): LN(W_ih x; gamma_ih) + b_ih and
    LN(W_hh h_in; gamma_hh) + b_hh replace the two affine parts. Matrix products by ``mm`` as in
    :func:`lstm_cell_step`.
    """
    mm = mm or _precision.Products.of(x_t)
    h_in = h if h_in is None else h_in
    h = h.to(mm.acc)
    xw, hw = mm.matmul(x_t, p["weight_ih"].T), mm.matmul(h_in, p["weight_hh"].T)
    if opt.layer_norm:
        xw, hw = _ln(xw, p["ln_ih_weight"]), _ln(hw, p["ln_hh_weight"])
    if "bias_ih" in p:
        xw, hw = xw + p["bias_ih"].to(mm.acc), hw + p["bias_hh"].to(mm.acc)
    xr, xz, xn = xw.chunk(3, dim=-1)
    hr, hz, hn = hw.chunk(3, dim=-1)
    r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
    n = torch.tanh(xn + r * hn)
    return (1 - z) * n + z * h


def lstm_reference(input, hx, layers, lengths, options: CellOptions, *, dropout=0.0, training=False, masks=None):
    """See :func:`fastlayers.rnn._cpu.lstm_engine` (same arguments and results)."""
    def step(x_t, states, h_in, p, mm):
        return lstm_cell_step(x_t, h_in, states[1], p, options, mm)

    return _reference(step, input, hx, layers, lengths, options, dropout, training, masks)


def gru_reference(input, hx, layers, lengths, options: CellOptions, *, dropout=0.0, training=False, masks=None):
    """See :func:`fastlayers.rnn._cpu.gru_engine` (same arguments and results)."""
    def step(x_t, states, h_in, p, mm):
        return (gru_cell_step(x_t, states[0], p, options, h_in, mm),)

    return _reference(step, input, hx, layers, lengths, options, dropout, training, masks)


def _reference(step, input, hx, layers, lengths, options, dropout, training, masks):
    """The layer/direction/time loops shared by both cells; states = (h,) or (h, c).

    Low-precision calls (see :mod:`fastlayers._core.precision`): states, gates and LayerNorm in float32,
    matrix-product operands in the low dtype, outputs and final states in the low dtype."""
    mm = _precision.Products.of(input)
    steps, batch, _ = input.shape
    padded = lengths is not None
    if lengths is None:
        lengths = torch.full((batch,), steps, dtype=torch.int64)
    lengths = lengths.to(input.device)
    dirs = len(layers[0])
    probs = options.zoneout  # (z_h, z_c)
    x = input
    finals: list[list[Tensor]] = [[] for _ in hx]
    for li, dir_params in enumerate(layers):
        m = (masks[li] if masks is not None else None) or {}
        outs = []
        for d, p in enumerate(dir_params):
            # parameters converted once per call: their gradients are summed over the steps in mm.acc
            p = {k: v.to(mm.acc) for k, v in p.items()}
            states = [s[li * dirs + d].to(mm.acc) for s in hx]
            rmask = m["recurrent"][d] if "recurrent" in m else None
            if rmask is None and training and options.recurrent_dropout > 0:
                keep = 1 - options.recurrent_dropout
                rmask = keep_mask(states[0].shape, keep, states[0].dtype, states[0].device) / keep
            ys: list[Tensor] = [None] * steps  # type: ignore[list-item]
            for t in (range(steps) if d == 0 else range(steps - 1, -1, -1)):
                alive = (t < lengths).unsqueeze(1)
                # a padded step's cell runs on zeros: its result is dropped below, and the zero
                # gradient it gets back would turn NaN on non-finite operands (0 * inf); so a
                # padded input is never read, and no NaN of a sequence reaches its padded steps
                live = [torch.where(alive, s, 0.0) for s in states] if padded else states
                h_in = live[0] * rmask if rmask is not None else live[0]
                new = step(torch.where(alive, x[t], 0.0) if padded else x[t], live, h_in, p, mm)
                for i, (old, upd) in enumerate(zip(states, new)):
                    key = ("zoneout_h", "zoneout_c")[i]
                    if key in m:  # given masks apply in any mode (as in the engine)
                        kept = m[key][d, t]
                    elif training and probs[i] > 0:  # (the order _remat.reference_draws repeats)
                        kept = keep_mask(old.shape, probs[i], old.dtype, old.device)
                    else:  # (eval: the expectation; training with probability 0: nothing to draw)
                        kept = probs[i]
                    if not (isinstance(kept, float) and kept == 0):  # (no zoneout: upd itself, as the
                        upd = kept * old + (1 - kept) * upd  # engines; 0 * an infinite old would be NaN)
                    if i == 0:
                        ys[t] = torch.where(alive, upd, torch.zeros_like(upd))
                    states[i] = torch.where(alive, upd, old)
            outs.append(torch.stack(ys).to(mm.low))
            for acc, s in zip(finals, states):
                acc.append(s.to(_precision.state_dtype(mm)))
        x = torch.cat(outs, dim=-1)
        if dropout > 0 and training and li < len(layers) - 1:
            x = F.dropout(x, dropout, True)
    return x, tuple(torch.stack(f) for f in finals)


def layer_options(consts: tuple[float, ...], *, cell: str, layer_norm: bool, peephole: bool = False) -> CellOptions:
    """The options one engine layer ran with, from its Function's constants: LSTM (cell_clip or 0,
    z_c, z_h, proj_clip or 0), GRU (z_h,). The z are the eval-mode constants (0 in training, where
    the masks are inputs); recurrent dropout comes as a mask, never sampled here."""
    if cell == "LSTM":
        clip, z_c, z_h, pclip = consts
        return CellOptions(layer_norm, peephole, clip or None, (z_h, z_c), 0.0, pclip or None)
    return CellOptions(layer_norm, False, None, (consts[0], 0.0), 0.0, None)


def layer_reference(cell: str, x: Tensor, params: list[dict[str, Tensor]], states: tuple[Tensor, ...],
                    lengths: Tensor | None, options: CellOptions, masks: dict[str, Tensor]) -> tuple[Tensor, ...]:
    """One layer, all directions, padded layout (the GPU engine's Functions): x (T, B, F), states
    (D, B, *), masks as :func:`lstm_reference`'s for one layer. Returns (y (T, B, D*P), *finals)."""
    run = lstm_reference if cell == "LSTM" else gru_reference
    y, finals = run(x, states, [params], lengths, options, masks=[masks])
    return (y, *finals)


def packed_layer_reference(cell: str, xs: Tensor, params: list[dict[str, Tensor]], states: tuple[Tensor, ...],
                           active: tuple[int, ...], options: CellOptions, masks: dict[str, Tensor | None]
                           ) -> tuple[Tensor, ...]:
    """One layer, all directions, on the CPU engine's packed rows (:mod:`._cpu_recurrence`): xs (D, N, F),
    each direction's rows in its own time order (step t's rows are the active prefix of the sorted
    batch, ``active[t]`` of them); states (D, B, *) in sorted batch order; masks ``recurrent`` (D, B, P)
    and the zoneout keep-masks ``zoneout_h`` (D, N, P), ``zoneout_c`` (D, N, H) on packed rows.
    Every direction runs forward over its rows laid out padded (differentiable index ops around
    :func:`lstm_reference` / :func:`gru_reference`). Returns (y (D, N, P), *finals (D, B, *))."""
    steps, batch = len(active), states[0].size(1)
    dev = xs.device
    pos = torch.cat([t * batch + torch.arange(n, device=dev) for t, n in enumerate(active)])
    lengths = (torch.tensor(active, device=dev).unsqueeze(1) > torch.arange(batch, device=dev)).sum(0)

    def padded(t: Tensor) -> Tensor:  # packed rows (N, X) -> (T, B, X), zeros at padding
        return t.new_zeros(steps * batch, t.size(-1)).index_copy(0, pos, t).view(steps, batch, -1)

    ys, finals = [], []
    for d, p in enumerate(params):
        m = {}
        if masks.get("recurrent") is not None:
            m["recurrent"] = masks["recurrent"][d:d + 1]
        for key in ("zoneout_h", "zoneout_c"):
            if masks.get(key) is not None:
                m[key] = padded(masks[key][d]).unsqueeze(0)
        y, *last = layer_reference(cell, padded(xs[d]), [p], tuple(s[d:d + 1] for s in states), lengths,
                                   options, m)
        ys.append(y.reshape(steps * batch, -1).index_select(0, pos))
        finals.append(last)
    return (torch.stack(ys), *(torch.cat(f) for f in zip(*finals)))


def recorded_layer_backward(cell: str, ctx, grads: tuple, inputs: tuple, layout) -> tuple[Tensor | None, ...]:
    """Gradients of an engine layer's autograd Function while its backward is recorded (create_graph):
    the vector-Jacobian product of this module's differentiable step loop on the saved ``inputs``
    (the Functions' tensor inputs, in their order: LSTM xs, w_ih, gx, bias (b_ih + b_hh), h0, c0,
    w_hh, gh, gc, bc, peep, w_hr, rmask, zc, zh; GRU xs, w_ih, gx, b_ih, h0, w_hh, b_hh, gh, rmask,
    zh), in the forward's precision (``ctx.mm``) and with its constants (``ctx.consts``).
    ``layout(xs, params, states, options, masks)`` runs the loop in the Function's layout."""
    needs = ctx.needs_input_grad[:len(inputs)]
    low, device = ctx.mm.low, inputs[0].device

    def layer(*tensors: Tensor | None) -> tuple[Tensor, ...]:
        if cell == "LSTM":
            xs, w_ih, gx, bias, h0, c0, w_hh, gh, gc, bc, peep, w_hr, rmask, zc, zh = tensors
            named = dict(weight_ih=w_ih, weight_hh=w_hh, bias_ih=bias, ln_ih_weight=gx, ln_hh_weight=gh,
                         ln_cell_weight=gc, ln_cell_bias=bc, weight_peephole=peep, weight_hr=w_hr)
            states, masks = (h0, c0), dict(recurrent=rmask, zoneout_c=zc, zoneout_h=zh)
        else:
            xs, w_ih, gx, b_ih, h0, w_hh, b_hh, gh, rmask, zh = tensors
            named = dict(weight_ih=w_ih, weight_hh=w_hh, bias_ih=b_ih, bias_hh=b_hh, ln_ih_weight=gx, ln_hh_weight=gh)
            states, masks = (h0,), dict(recurrent=rmask, zoneout_h=zh)
        params = [{k: v[d] for k, v in named.items() if v is not None} for d in range(w_ih.size(0))]
        if cell == "LSTM" and bias is not None:  # the LSTM Functions take b_ih + b_hh as one bias
            params = [{**p, "bias_hh": torch.zeros_like(p["bias_ih"])} for p in params]
        options = layer_options(ctx.consts, cell=cell, layer_norm=gx is not None,
                                peephole=cell == "LSTM" and peep is not None)
        with torch.autocast(device.type, dtype=low, enabled=low in _precision.LOW and xs.dtype != low):
            return layout(xs, params, states, options, {k: v for k, v in masks.items() if v is not None})

    return twice.recorded_vjp(layer, inputs, grads, needs)


def reference_varlen_rnn(
    input: Tensor,
    hx: tuple[Tensor, ...],
    weights: Sequence[Tensor],
    lengths: Tensor,
    *,
    mode: str,
    has_biases: bool,
    num_layers: int,
    bidirectional: bool,
    batch_first: bool,
    dropout: float,
    training: bool,
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """See :func:`fastlayers.rnn._varlen.varlen_rnn`; computed with pack/pad_packed_sequence."""
    steps = input.size(1 if batch_first else 0)
    packed = pack_padded_sequence(input, lengths, batch_first=batch_first, enforce_sorted=False)
    state = tuple(s.index_select(1, packed.sorted_indices) for s in hx)
    result = KERNELS[mode](
        packed.data,
        packed.batch_sizes,
        state if mode == "LSTM" else state[0],
        list(weights),
        has_biases,
        num_layers,
        dropout,
        training,
        bidirectional,
    )
    output, _ = pad_packed_sequence(
        packed._replace(data=result[0]), batch_first=batch_first, total_length=steps
    )
    return output, tuple(s.index_select(1, packed.unsorted_indices) for s in result[1:])
