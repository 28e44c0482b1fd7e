"""Per-step reference of the engine's LSTM with cell options: plain torch ops, autograd, no kernels.

Written from the equations (see :class:`fastlayers.rnn._options.CellOptions`), independently of
the engine: original time order, the reverse direction walks t = T-1 .. 0 with a per-sequence
activity mask instead of gathers. Same signature as :func:`fastlayers.rnn._engine.lstm_engine`;
the test oracle (run in float64) and the path for devices without the C kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._options import CellOptions

EPS = 1e-5


def _ln(v: Tensor, gain: Tensor, bias: Tensor | None = None) -> Tensor:
    mean = v.mean(-1, keepdim=True)
    var = ((v - mean) ** 2).mean(-1, keepdim=True)
    out = (v - mean) / torch.sqrt(var + EPS) * gain
    return out + bias if bias is not None else out


def lstm_cell_step(x_t, h, c, p, opt: CellOptions):
    """One LSTM step with options (before zoneout): returns (h_new (B, H_out), c_new (B, H)).

    With a projection (``weight_hr`` (P, H) in p, torch's proj_size): h_new = W_hr (o * tanh(.)),
    clipped to [-proj_clip, proj_clip] if set; H_out = P.
    """
    hidden = c.size(-1)
    xw = x_t @ p["weight_ih"].T
    hw = h @ p["weight_hh"].T
    if opt.layer_norm:
        xw, hw = _ln(xw, p["ln_ih_weight"]), _ln(hw, p["ln_hh_weight"])
    pre = xw + hw
    if "bias_ih" in p:
        pre = pre + p["bias_ih"] + p["bias_hh"]
    pi, pf, pg, po = pre.split(hidden, dim=-1)
    if opt.peephole:
        wi, wf, wo = p["weight_peephole"].split(hidden)
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
        h_new = h_new @ p["weight_hr"].T
        if opt.proj_clip:
            h_new = h_new.clamp(-opt.proj_clip, opt.proj_clip)
    return h_new, c_new


def lstm_reference(input, hx, layers, lengths, options: CellOptions, *, dropout=0.0, training=False, masks=None):
    """See :func:`fastlayers.rnn._engine.lstm_engine` (same arguments and results)."""
    steps, batch, _ = input.shape
    if lengths is None:
        lengths = torch.full((batch,), steps, dtype=torch.int64)
    lengths = lengths.to(input.device)
    z_h, z_c = options.zoneout
    dirs = len(layers[0])
    x = input
    h_n, c_n = [], []
    for li, dir_params in enumerate(layers):
        m = (masks[li] if masks is not None else None) or {}
        outs = []
        for d, p in enumerate(dir_params):
            k = li * dirs + d
            h, c = hx[0][k], hx[1][k]
            rmask = m["recurrent"][d] if "recurrent" in m else None
            if rmask is None and training and options.recurrent_dropout > 0:
                keep = 1 - options.recurrent_dropout
                rmask = torch.bernoulli(torch.full_like(h, keep)) / keep
            ys: list[Tensor] = [None] * steps  # type: ignore[list-item]
            for t in (range(steps) if d == 0 else range(steps - 1, -1, -1)):
                alive = (t < lengths).unsqueeze(1)
                h_in = h * rmask if rmask is not None else h
                h1, c1 = lstm_cell_step(x[t], h_in, c, p, options)
                if training:
                    kc = m["zoneout_c"][d, t] if "zoneout_c" in m else torch.bernoulli(torch.full_like(c, z_c))
                    kh = m["zoneout_h"][d, t] if "zoneout_h" in m else torch.bernoulli(torch.full_like(h, z_h))
                else:
                    kc, kh = z_c, z_h
                c1 = kc * c + (1 - kc) * c1
                h1 = kh * h + (1 - kh) * h1
                c = torch.where(alive, c1, c)
                h = torch.where(alive, h1, h)
                ys[t] = torch.where(alive, h1, torch.zeros_like(h1))
            outs.append(torch.stack(ys))
            h_n.append(h)
            c_n.append(c)
        x = torch.cat(outs, dim=-1)
        if dropout > 0 and training and li < len(layers) - 1:
            x = F.dropout(x, dropout, True)
    return x, (torch.stack(h_n), torch.stack(c_n))
