"""Per-step reference of the engine's LSTM / GRU with cell options: plain torch ops, autograd, no kernels.

Written from the equations (see :class:`fastlayers.rnn._options.CellOptions`), independently of
the engine: original time order, the reverse direction walks t = T-1 .. 0 with a per-sequence
activity mask instead of gathers. Same signatures as :func:`fastlayers.rnn._engine.lstm_engine` /
``gru_engine``;
the test oracle (run in float64) and the path for devices without the C kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _precision
from ._options import CellOptions

EPS = 1e-5


def _ln(v: Tensor, gain: Tensor, bias: Tensor | None = None) -> Tensor:
    """LayerNorm over the last dimension in v's dtype (float32 for low-precision calls)."""
    mean = v.mean(-1, keepdim=True)
    var = ((v - mean) ** 2).mean(-1, keepdim=True)
    out = (v - mean) / torch.sqrt(var + EPS) * gain.to(v.dtype)
    return out + bias.to(v.dtype) if bias is not None else out


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
    """See :func:`fastlayers.rnn._engine.lstm_engine` (same arguments and results)."""
    def step(x_t, states, h_in, p, mm):
        return lstm_cell_step(x_t, h_in, states[1], p, options, mm)

    return _reference(step, input, hx, layers, lengths, options, dropout, training, masks)


def gru_reference(input, hx, layers, lengths, options: CellOptions, *, dropout=0.0, training=False, masks=None):
    """See :func:`fastlayers.rnn._engine.gru_engine` (same arguments and results)."""
    def step(x_t, states, h_in, p, mm):
        return (gru_cell_step(x_t, states[0], p, options, h_in, mm),)

    return _reference(step, input, hx, layers, lengths, options, dropout, training, masks)


def _reference(step, input, hx, layers, lengths, options, dropout, training, masks):
    """The layer/direction/time loops shared by both cells; states = (h,) or (h, c).

    Low-precision calls (see :mod:`fastlayers._precision`): states, gates and LayerNorm in float32,
    matrix-product operands in the low dtype, outputs and final states in the low dtype."""
    mm = _precision.Products.of(input)
    steps, batch, _ = input.shape
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
                rmask = torch.bernoulli(torch.full_like(states[0], keep)) / keep
            ys: list[Tensor] = [None] * steps  # type: ignore[list-item]
            for t in (range(steps) if d == 0 else range(steps - 1, -1, -1)):
                alive = (t < lengths).unsqueeze(1)
                h_in = states[0] * rmask if rmask is not None else states[0]
                new = step(x[t], states, h_in, p, mm)
                for i, (old, upd) in enumerate(zip(states, new)):
                    key = ("zoneout_h", "zoneout_c")[i]
                    if training:
                        keep_mask = m[key][d, t] if key in m else torch.bernoulli(torch.full_like(old, probs[i]))
                    else:
                        keep_mask = probs[i]
                    upd = keep_mask * old + (1 - keep_mask) * upd
                    if i == 0:
                        ys[t] = torch.where(alive, upd, torch.zeros_like(upd))
                    states[i] = torch.where(alive, upd, old)
            outs.append(torch.stack(ys).to(mm.low))
            for acc, s in zip(finals, states):
                acc.append(s.to(mm.low))
        x = torch.cat(outs, dim=-1)
        if dropout > 0 and training and li < len(layers) - 1:
            x = F.dropout(x, dropout, True)
    return x, tuple(torch.stack(f) for f in finals)
