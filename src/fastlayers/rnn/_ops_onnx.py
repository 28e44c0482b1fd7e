"""ONNX translations of the recurrent layers' operators (``fastlayers::lstm_padded``, ``gru_padded``,
``rnn_padded``, :mod:`._ops_export`) for ``torch.onnx.export(..., dynamo=True)``.

Legend: T time, B batch, F input features, H hidden size, P output size (proj_size, or H), G gates
(4H LSTM, 3H GRU), D directions.

Each translation receives the operator's arguments as the exporter passes them (ONNX values for
tensors, None for absent optional tensors, Python floats / bools for the scalars) and records ONNX
nodes with onnxscript's opset 18:

* a layer without cell options (LSTM also without proj_size; peepholes allowed) becomes one ONNX
  ``LSTM`` / ``GRU`` / ``RNN`` node: the gates reordered (torch's LSTM i, f, g, o -> ONNX's i, o,
  f, c; GRU r, z, n -> z, r, h with ``linear_before_reset=1``; peepholes w_ci, w_cf, w_co -> P's
  i, o, f), the biases concatenated (W_b then R_b), the lengths as ``sequence_lens`` (int32),
  bidirectional as ``direction="bidirectional"``, and ONNX's Y (T, D, B, H) as (T, B, D*H);
* a layer with cell options (layer_norm, cell_clip, zoneout in eval, proj_size and proj_clip; GRU
  layer_norm and zoneout) becomes the input projection of every step as one MatMul, then one ONNX
  ``Scan`` over time whose body (:func:`_lstm_body`, :func:`_gru_body`, built with
  ``onnxscript.build_graph``) runs one step of every direction at once (the directions batched in
  the states (D, B, *)). The reverse direction runs forward over
  ``ReverseSequence(x, lengths)`` (each sequence reversed within its own length) and its output is
  reversed back: the packed semantics. With lengths, a step at t >= len_b keeps the state and
  writes zeros.

Constants (clip bounds, zoneout probabilities) are the Python floats rounded once to the layer's
dtype, as torch rounds them; the LayerNorms' epsilon is ONNX's float attribute (1e-5 in float32,
which a float64 layer sees as a 3e-8 relative change of its epsilon).

Training masks (zoneout / recurrent dropout drawn in training mode) are refused with a ValueError:
export in eval mode. The translations run only inside the exporter (its graph recorder is
onnxscript's default evaluator there).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np
import onnxscript
from onnxscript import ir, opset18 as op

EPS = 1e-5  # the LayerNorms' epsilon (_reference.EPS, _native/ops.cpp kEps)
_LSTM_TO_ONNX = (0, 3, 1, 2)  # torch's i, f, g, o -> ONNX's i, o, f, c
_GRU_TO_ONNX = (1, 0, 2)  # torch's r, z, n -> ONNX's z, r, h
_PEEPHOLE_TO_ONNX = (0, 2, 1)  # fastlayers' w_ci, w_cf, w_co -> ONNX P's i, o, f
_names = itertools.count()

Value = ir.Value


# ---- helpers

def refuse_masks(name: str, **masks: object) -> None:
    """ValueError where the layer was exported in training mode with masks drawn (zoneout / recurrent
    dropout): ONNX has no random masks of that kind; deploy exports in eval mode."""
    what = {"rmask": "recurrent dropout", "zc": "zoneout of c", "zh": "zoneout of h"}
    given = [what[k] for k, v in masks.items() if v is not None]
    if given:
        raise ValueError(
            f"fastlayers.onnx: {name} was traced in training mode, drawing random masks ({', '.join(given)}), "
            "which ONNX cannot reproduce; call model.eval() before exporting to ONNX (eval mode uses zoneout's "
            "expectation and no recurrent dropout)")


def _dims(v: Value) -> tuple:
    if v.shape is None:
        raise ValueError(f"fastlayers.onnx: the shape of {v.name} is unknown to the exporter")
    return tuple(v.shape)


def _reorder(t: Value, axis: int, parts: int, order: Sequence[int]) -> Value:
    """t's `parts` equal blocks along `axis` in the given order (gate reordering): one Gather with
    constant indices, which the exporter's optimizer folds into the weights."""
    size = _dims(t)[axis] // parts
    index = np.concatenate([np.arange(i * size, (i + 1) * size) for i in order]).astype(np.int64)
    return op.Gather(t, op.Constant(value=ir.tensor(index)), axis=axis)


def _scalar(value: float, like: Value) -> Value:
    """A scalar constant of like's dtype, rounded once from the Python float (as torch rounds a
    Python scalar to the tensor's dtype)."""
    if like.dtype is None:
        return op.CastLike(op.Constant(value_float=float(value)), like)
    return op.Constant(value=ir.tensor(np.asarray(value, dtype=like.dtype.numpy())))


def _ints(*values: int) -> Value:
    return op.Constant(value_ints=list(values))


def _record(op_type: str, inputs: Sequence[Value | None], outputs: int, **attributes: object) -> Sequence[Value]:
    """A node with several outputs (Scan) appended to the exporter's graph recorder, the default
    onnxscript evaluator while a translation runs (its ``op.Scan`` would give one output)."""
    recorder = onnxscript.evaluator.default()
    nodes = getattr(recorder, "nodes", None)
    opset = getattr(recorder, "opset", None)
    if not isinstance(nodes, list) or opset is None:
        raise RuntimeError("fastlayers.onnx: the recurrent layers' translations run inside torch.onnx.export(..., "
                           "dynamo=True) (fastlayers.onnx.export); this torch's ONNX graph recorder "
                           f"({type(recorder).__name__}) has no node list")
    node = ir.Node("", op_type, list(inputs), attributes=ir.convenience.convert_attributes(attributes),
                   num_outputs=outputs, version=opset.version)
    nodes.append(node)
    return node.outputs


def _layer_norm(v: Value, ones: Value, gain: Value, bias: Value | None, ops=op) -> Value:
    """gain * (v - mean) / sqrt(var + eps) + bias over the last axis (ONNX LayerNormalization with a
    unit scale, then the per-direction gain (D, 1, X) and bias)."""
    y = ops.LayerNormalization(v, ones, axis=-1, epsilon=EPS)
    y = y[0] if isinstance(y, Sequence) else y
    y = ops.Mul(y, gain)
    return ops.Add(y, bias) if bias is not None else y


def _per_direction(t: Value | None) -> Value | None:
    """(D, X) -> (D, 1, X): broadcast against (D, B, X) states."""
    return None if t is None else op.Unsqueeze(t, _ints(1))


# ---- plain layers: ONNX's own operators

def _native_output(y: Value) -> Value:
    """ONNX's Y (T, D, B, H) -> (T, B, D*H)."""
    return op.Reshape(op.Transpose(y, perm=[0, 2, 1, 3]), _ints(0, 0, -1))


def _native_bias(b_ih: Value | None, b_hh: Value | None, parts: int, order: Sequence[int]) -> Value | None:
    """ONNX's B (D, 2G): W_b then R_b, each in ONNX's gate order (a missing one as zeros)."""
    if b_ih is None and b_hh is None:
        return None
    b_ih = b_ih if b_ih is not None else op.Sub(b_hh, b_hh)
    b_hh = b_hh if b_hh is not None else op.Sub(b_ih, b_ih)
    if parts > 1:
        b_ih, b_hh = _reorder(b_ih, 1, parts, order), _reorder(b_hh, 1, parts, order)
    return op.Concat(b_ih, b_hh, axis=1)


def _sequence_lens(lengths: Value | None) -> Value | None:
    return None if lengths is None else op.Cast(lengths, to=ir.DataType.INT32)


def _direction(dirs: int) -> str:
    return "bidirectional" if dirs == 2 else "forward"


def _lstm_native(x, lengths, h0, c0, w_ih, w_hh, b_ih, b_hh, peephole):
    dirs, gates, _ = _dims(w_ih)
    w = _reorder(w_ih, 1, 4, _LSTM_TO_ONNX)
    r = _reorder(w_hh, 1, 4, _LSTM_TO_ONNX)
    p = None if peephole is None else _reorder(peephole, 1, 3, _PEEPHOLE_TO_ONNX)
    y, h, c = op.LSTM(x, w, r, _native_bias(b_ih, b_hh, 4, _LSTM_TO_ONNX), _sequence_lens(lengths), h0, c0, p,
                      direction=_direction(dirs), hidden_size=gates // 4)
    return _native_output(y), h, c


def _gru_native(x, lengths, h0, w_ih, w_hh, b_ih, b_hh):
    dirs, gates, _ = _dims(w_ih)
    y, h = op.GRU(x, _reorder(w_ih, 1, 3, _GRU_TO_ONNX), _reorder(w_hh, 1, 3, _GRU_TO_ONNX),
                  _native_bias(b_ih, b_hh, 3, _GRU_TO_ONNX), _sequence_lens(lengths), h0,
                  direction=_direction(dirs), hidden_size=gates // 3, linear_before_reset=1)
    return _native_output(y), h


# ---- layers with cell options: one Scan over time

class _Scan:
    """What the Scan of one layer shares between its set-up and its body: the directions' inputs
    (T, D, B, G) projected before the loop, the lengths mask, and the output assembly."""

    def __init__(self, x: Value, lengths: Value | None, w_ih: Value):
        self.dirs = _dims(w_ih)[0]
        self.x = x
        self.uid = next(_names)
        self.dtype = x.dtype
        steps = op.Shape(x, start=0, end=1)
        if lengths is not None:
            self.lens = op.Cast(lengths, to=ir.DataType.INT64)
        else:
            self.lens = op.Expand(steps, op.Shape(x, start=1, end=2)) if self.dirs == 2 else None
        self.alive = None
        if lengths is not None:  # (T, B, 1): step t runs sequence b
            t = op.Range(_ints_scalar(0), op.Squeeze(steps, _ints(0)), _ints_scalar(1))
            self.alive = op.Unsqueeze(op.Less(op.Unsqueeze(t, _ints(1)), op.Unsqueeze(self.lens, _ints(0))), _ints(2))

    def inputs(self) -> Value:
        """x as (T, D, B, F): the reverse direction's sequences reversed within their lengths."""
        xs = op.Unsqueeze(self.x, _ints(1))
        if self.dirs == 2:
            reverse = op.ReverseSequence(self.x, self.lens, batch_axis=1, time_axis=0)
            xs = op.Concat(xs, op.Unsqueeze(reverse, _ints(1)), axis=1)
        return xs

    def value(self, name: str) -> Value:
        """A fresh body input of the layer's dtype."""
        return ir.Value(name=f"fastlayers_scan{self.uid}_{name}", type=ir.TensorType(self.dtype))

    def run(self, body: Callable, states: Sequence[Value], xp: Value, names: Sequence[str]) -> list[Value]:
        """Scan body over (xp (T, D, B, G), alive (T, B, 1)) with the states; returns the final
        states and the output (T, B, D*P)."""
        scans = [xp] + ([self.alive] if self.alive is not None else [])
        body_inputs = [self.value(n) for n in names] + [self.value("xp_t")]
        if self.alive is not None:
            body_inputs.append(ir.Value(name=f"fastlayers_scan{self.uid}_alive_t", type=ir.TensorType(ir.DataType.BOOL)))
        body_outputs = [self.value(f"{n}_next") for n in names] + [self.value("y_t")]
        graph = onnxscript.build_graph(body, body_inputs, body_outputs, opset_imports={"": 18},
                                       name=f"fastlayers_step{self.uid}")
        outs = _record("Scan", [*states, *scans], len(names) + 1, body=graph, num_scan_inputs=len(scans))
        *finals, ys = outs  # ys (T, D, B, P)
        if self.dirs == 1:
            y = op.Squeeze(ys, _ints(1))
        else:
            forward = op.Gather(ys, _ints_scalar(0), axis=1)
            reverse = op.ReverseSequence(op.Gather(ys, _ints_scalar(1), axis=1), self.lens, batch_axis=1, time_axis=0)
            y = op.Concat(forward, reverse, axis=-1)
        return [y, *finals]


def _ints_scalar(value: int) -> Value:
    return op.Constant(value_int=value)


def _keep(b, alive: Value | None, new: Value, old: Value, zero: Value | None = None) -> tuple[Value, Value | None]:
    """(next state, output y_t) of a step: where the sequence has ended (alive false), the old
    state and zeros; the output only where ``zero`` is given (a graph output of its own)."""
    if alive is None:
        return new, (b.Identity(new) if zero is not None else None)
    return b.Where(alive, new, old), (b.Where(alive, new, zero) if zero is not None else None)


def _zoneout(b, z: float, keep: Value | None, drop: Value | None, old: Value, new: Value) -> Value:
    """Zoneout's eval-mode expectation z * old + (1 - z) * new."""
    return b.Add(b.Mul(keep, old), b.Mul(drop, new)) if z else new


def _projected(scan: _Scan, x: Value, w_ih: Value, ln_ih: Value | None, biases: Sequence[Value | None]
               ) -> tuple[Value, Value | None]:
    """Every step's input projection before the Scan: (T, D, B, G) = x W_ih^T, its LayerNorm (gain
    ln_ih) where given, plus the biases added outside the recurrence (LSTM: b_ih and b_hh; GRU: b_ih);
    and the (G,) ones the LayerNorms of that width use (None without layer_norm)."""
    xp = op.MatMul(scan.inputs(), op.Transpose(w_ih, perm=[0, 2, 1]))
    ones = None
    if ln_ih is not None:
        ones = op.Expand(_scalar(1.0, x), _ints(_dims(w_ih)[1]))
        xp = _layer_norm(xp, ones, _per_direction(ln_ih), None)
    for b in biases:
        if b is not None:
            xp = op.Add(xp, _per_direction(b))
    return xp, ones


def _lstm_scan(x, lengths, h0, c0, w_ih, w_hh, b_ih, b_hh, ln_ih, ln_hh, ln_cell_weight, ln_cell_bias, peephole,
               w_hr, cell_clip, z_c, z_h, proj_clip):
    scan = _Scan(x, lengths, w_ih)
    hidden = _dims(w_hh)[1] // 4
    xp, gates_ones = _projected(scan, x, w_ih, ln_ih, (b_ih, b_hh))  # (T, D, B, 4H)
    w_hh_t = op.Transpose(w_hh, perm=[0, 2, 1])  # (D, P, 4H)
    w_hr_t = None if w_hr is None else op.Transpose(w_hr, perm=[0, 2, 1])  # (D, H, P)
    g_hh = _per_direction(ln_hh)
    g_c, b_c = _per_direction(ln_cell_weight), _per_direction(ln_cell_bias)
    cell_ones = op.Expand(_scalar(1.0, x), _ints(hidden)) if ln_cell_weight is not None else None
    peep = None
    if peephole is not None:
        peep = [op.Slice(_per_direction(peephole), _ints(k * hidden), _ints((k + 1) * hidden), _ints(2))
                for k in range(3)]  # (D, 1, H) each: w_ci, w_cf, w_co
    clip = (_scalar(-cell_clip, x), _scalar(cell_clip, x)) if cell_clip else None
    pclip = (_scalar(-proj_clip, x), _scalar(proj_clip, x)) if proj_clip and w_hr is not None else None
    zh = (_scalar(z_h, x), _scalar(1.0 - z_h, x)) if z_h else (None, None)
    zc = (_scalar(z_c, x), _scalar(1.0 - z_c, x)) if z_c else (None, None)
    zero = _scalar(0.0, x)

    def body(b, h, c, xp_t, alive=None):
        return _lstm_body(b, h, c, xp_t, alive, w_hh_t=w_hh_t, gates_ones=gates_ones, g_hh=g_hh, cell_ones=cell_ones,
                          g_c=g_c, b_c=b_c, peep=peep, clip=clip, w_hr_t=w_hr_t, pclip=pclip, zh=zh, zc=zc,
                          z_h=z_h, z_c=z_c, zero=zero)

    y, h, c = scan.run(body, [h0, c0], xp, ("h", "c"))
    return y, h, c


def _lstm_body(b, h, c, xp_t, alive, *, w_hh_t, gates_ones, g_hh, cell_ones, g_c, b_c, peep, clip, w_hr_t, pclip,
               zh, zc, z_h, z_c, zero):
    """One LSTM step of every direction: h (D, B, P), c (D, B, H), xp_t (D, B, 4H) the projected input
    (with its LayerNorm and both biases), alive (B, 1) or None -> (h', c', y_t)."""
    hw = b.MatMul(h, w_hh_t)
    if g_hh is not None:
        hw = _layer_norm(hw, gates_ones, g_hh, None, b)
    pi, pf, pg, po = b.Split(b.Add(xp_t, hw), axis=-1, num_outputs=4, _outputs=4)
    if peep is not None:
        pi, pf = b.Add(pi, b.Mul(peep[0], c)), b.Add(pf, b.Mul(peep[1], c))
    c_new = b.Add(b.Mul(b.Sigmoid(pf), c), b.Mul(b.Sigmoid(pi), b.Tanh(pg)))
    if clip is not None:
        c_new = b.Clip(c_new, *clip)
    if peep is not None:
        po = b.Add(po, b.Mul(peep[2], c_new))
    n = _layer_norm(c_new, cell_ones, g_c, b_c, b) if g_c is not None else c_new
    h_new = b.Mul(b.Sigmoid(po), b.Tanh(n))
    if w_hr_t is not None:
        h_new = b.MatMul(h_new, w_hr_t)
        if pclip is not None:
            h_new = b.Clip(h_new, *pclip)
    h_new = _zoneout(b, z_h, *zh, h, h_new)
    c_new = _zoneout(b, z_c, *zc, c, c_new)
    h_next, y = _keep(b, alive, h_new, h, zero)
    c_next, _ = _keep(b, alive, c_new, c)
    return h_next, c_next, y


def _gru_scan(x, lengths, h0, w_ih, w_hh, b_ih, b_hh, ln_ih, ln_hh, z_h):
    scan = _Scan(x, lengths, w_ih)
    xp, ones = _projected(scan, x, w_ih, ln_ih, (b_ih,))  # (T, D, B, 3H)
    w_hh_t = op.Transpose(w_hh, perm=[0, 2, 1])
    g_hh, bias_hh = _per_direction(ln_hh), _per_direction(b_hh)
    zh = (_scalar(z_h, x), _scalar(1.0 - z_h, x)) if z_h else (None, None)
    one, zero = _scalar(1.0, x), _scalar(0.0, x)

    def body(b, h, xp_t, alive=None):
        return _gru_body(b, h, xp_t, alive, w_hh_t=w_hh_t, ones=ones, g_hh=g_hh, bias_hh=bias_hh, zh=zh, z_h=z_h,
                         one=one, zero=zero)

    y, h = scan.run(body, [h0], xp, ("h",))
    return y, h


def _gru_body(b, h, xp_t, alive, *, w_hh_t, ones, g_hh, bias_hh, zh, z_h, one, zero):
    """One GRU step of every direction (torch.nn.GRU's equations, haste's LayerNorm): h (D, B, H),
    xp_t (D, B, 3H) the projected input (with its LayerNorm and b_ih), alive (B, 1) or None."""
    hw = b.MatMul(h, w_hh_t)
    if g_hh is not None:
        hw = _layer_norm(hw, ones, g_hh, None, b)
    if bias_hh is not None:
        hw = b.Add(hw, bias_hh)
    xr, xz, xn = b.Split(xp_t, axis=-1, num_outputs=3, _outputs=3)
    hr, hz, hn = b.Split(hw, axis=-1, num_outputs=3, _outputs=3)
    r, z = b.Sigmoid(b.Add(xr, hr)), b.Sigmoid(b.Add(xz, hz))
    n = b.Tanh(b.Add(xn, b.Mul(r, hn)))
    h_new = b.Add(b.Mul(b.Sub(one, z), n), b.Mul(z, h))
    h_new = _zoneout(b, z_h, *zh, h, h_new)
    h_next, y = _keep(b, alive, h_new, h, zero)
    return h_next, y


# ---- the translations (the operators' schemas: _native/ops.cpp)

def lstm_padded(x, lengths, h0, c0, w_ih, w_hh, b_ih=None, b_hh=None, ln_ih=None, ln_hh=None, ln_cell_weight=None,
                ln_cell_bias=None, peephole=None, w_hr=None, rmask=None, zc=None, zh=None, cell_clip=0.0, z_c=0.0,
                z_h=0.0, proj_clip=0.0):
    """``fastlayers::lstm_padded`` -> ONNX LSTM (no options but peepholes) or a Scan; returns
    (y (T, B, D*P), h (D, B, P), c (D, B, H))."""
    refuse_masks("fastlayers.LSTM", rmask=rmask, zc=zc, zh=zh)
    if ln_ih is None and w_hr is None and not cell_clip and not z_c and not z_h:
        return _lstm_native(x, lengths, h0, c0, w_ih, w_hh, b_ih, b_hh, peephole)
    return _lstm_scan(x, lengths, h0, c0, w_ih, w_hh, b_ih, b_hh, ln_ih, ln_hh, ln_cell_weight, ln_cell_bias,
                      peephole, w_hr, cell_clip, z_c, z_h, proj_clip)


def gru_padded(x, lengths, h0, w_ih, w_hh, b_ih=None, b_hh=None, ln_ih=None, ln_hh=None, rmask=None, zh=None,
               z_h=0.0):
    """``fastlayers::gru_padded`` -> ONNX GRU (no options) or a Scan; returns (y (T, B, D*H), h (D, B, H))."""
    refuse_masks("fastlayers.GRU", rmask=rmask, zh=zh)
    if ln_ih is None and not z_h:
        return _gru_native(x, lengths, h0, w_ih, w_hh, b_ih, b_hh)
    return _gru_scan(x, lengths, h0, w_ih, w_hh, b_ih, b_hh, ln_ih, ln_hh, z_h)


def rnn_padded(x, lengths, h0, w_ih, w_hh, b_ih=None, b_hh=None, relu=False):
    """``fastlayers::rnn_padded`` -> ONNX RNN (Tanh or Relu); returns (y (T, B, D*H), h (D, B, H))."""
    dirs, hidden, _ = _dims(w_ih)
    y, h = op.RNN(x, w_ih, w_hh, _native_bias(b_ih, b_hh, 1, (0,)), _sequence_lens(lengths), h0,
                  activations=["Relu" if relu else "Tanh"] * dirs, direction=_direction(dirs), hidden_size=hidden)
    return _native_output(y), h


def translations() -> dict[str, Callable]:
    """The recurrent operators' translations by qualified name (``fastlayers::<op>``)."""
    return {"fastlayers::lstm_padded": lstm_padded, "fastlayers::gru_padded": gru_padded,
            "fastlayers::rnn_padded": rnn_padded}
