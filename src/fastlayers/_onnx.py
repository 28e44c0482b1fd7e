"""The translation table of fastlayers' C++ operators for torch.onnx's dynamo exporter, and the
translation of ``fastlayers::locally_connected2d`` (the recurrent ones: :mod:`fastlayers.rnn._onnx`).

Imported by :mod:`fastlayers.onnx` only (it imports onnxscript, which ``import fastlayers`` does not).

Legend (locally connected): B batch, C in channels, O out channels, KH x KW kernel, OH x OW output,
L = OH * OW output locations.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from onnxscript import opset18 as op

from . import _ops_lib


def _ints(*values: int):
    return op.Constant(value_ints=list(values))


def locally_connected2d(input, weight, bias, stride, padding, dilation):
    """``fastlayers::locally_connected2d`` -> one strided Slice of the padded input per kernel offset,
    gathered into (L, B, C*KH*KW) patches, and one batched MatMul with the weight as (L, C*KH*KW, O):
    input (B, C, H, W), weight (O, C, KH, KW, OH, OW), bias (O, OH, OW) or None -> (B, O, OH, OW).
    The batch stays dynamic; the spatial sizes are the weight's (static)."""
    out_c, in_c, kh, kw, oh, ow = (int(d) for d in weight.shape)
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    x = op.Pad(input, _ints(0, 0, ph, pw, 0, 0, ph, pw)) if ph or pw else input
    taps = []
    for p in range(kh):
        for q in range(kw):
            h0, w0 = p * dh, q * dw
            tap = op.Slice(x, _ints(h0, w0), _ints(h0 + sh * (oh - 1) + 1, w0 + sw * (ow - 1) + 1), _ints(2, 3),
                           _ints(sh, sw))  # (B, C, OH, OW)
            taps.append(op.Unsqueeze(tap, _ints(2)))
    patches = op.Concat(*taps, axis=2) if len(taps) > 1 else taps[0]  # (B, C, KH*KW, OH, OW)
    patches = op.Transpose(op.Reshape(patches, _ints(0, in_c * kh * kw, oh * ow)), perm=[2, 0, 1])  # (L, B, CKK)
    w = op.Transpose(op.Reshape(weight, _ints(out_c, in_c * kh * kw, oh * ow)), perm=[2, 1, 0])  # (L, CKK, O)
    y = op.Reshape(op.Transpose(op.MatMul(patches, w), perm=[1, 2, 0]), _ints(0, out_c, oh, ow))
    return op.Add(y, bias) if bias is not None else y


def table() -> dict[Callable, Callable]:
    """{operator overload: translation} for every fastlayers operator a model's export can contain;
    empty where the operator library cannot be built or loaded (then the recurrent layers do not
    export at all, saying why, and the locally connected layers export their plain-PyTorch path)."""
    if not _ops_lib.load():
        return {}
    from .rnn import _onnx

    ops = torch.ops.fastlayers
    return {ops.lstm_padded.default: _onnx.lstm_padded, ops.gru_padded.default: _onnx.gru_padded,
            ops.rnn_padded.default: _onnx.rnn_padded, ops.locally_connected2d.default: locally_connected2d}
