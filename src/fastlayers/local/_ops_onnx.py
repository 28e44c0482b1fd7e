"""The ONNX translation of ``fastlayers::locally_connected2d`` for torch.onnx's dynamo exporter
(collected by :func:`fastlayers.onnx.translations`; imported only there, as it imports onnxscript).

Legend: B batch, C in channels, O out channels, KH x KW kernel, OH x OW output, L = OH * OW output
locations.
"""

from __future__ import annotations

from onnxscript import opset18 as op


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


def translations() -> dict:
    """The locally connected operator's translation by qualified name."""
    return {"fastlayers::locally_connected2d": locally_connected2d}
