"""Step-wise cells: drop-in torch.nn.LSTMCell / GRUCell / RNNCell, plus the layers' cell options.

Legend: B batch, F = input_size, H = hidden_size, P = proj_size if > 0 else H (LSTM's h size).

:func:`step` is the one step shared by the cell modules and the layers' ``cell(layer, direction)``
views, so both give bitwise-equal steps for equal parameters: options off, torch's fused cell
kernels (``torch._VF.lstm_cell`` / ``gru_cell`` / ``rnn_*_cell``, what torch.nn's cells run);
any option on, the engine's per-step equations (:func:`._reference.lstm_cell_step` /
``gru_cell_step``, written from the papers) and zoneout: as torch ops, or, with the same
equations, as the C++ operator over one step (CPU, no autograd) or the layers' Triton step kernels
(:mod:`._gpu_cell`: CUDA, forward and backward).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor, nn

from .._native import ops_lib
from .._core import precision as _precision, twice
from .._core.backend import cpu_kernels, forced, select, transformed
from .._core.jit import NotScriptable
from . import _gpu_cell
from ._reference import gru_cell_step, lstm_cell_step
from ._masks import keep_mask
from ._options import CellOptions
from ._validate import check_cell, check_mask, check_parameter_dtypes


def step(mode: str, x: Tensor, states: tuple[Tensor, ...], params: dict[str, Tensor], options: CellOptions, *,
         training: bool = False, recurrent_mask: Tensor | None = None, nonlinearity: str = "tanh"
         ) -> tuple[Tensor, ...]:
    """One step: x (B, F), states (h (B, P), c (B, H)) for LSTM or (h (B, H),) -> the new states.

    ``params``: weight_ih, weight_hh, optional bias_ih / bias_hh and the option parameters
    (ln_ih_weight, ln_hh_weight, ln_cell_weight, ln_cell_bias, weight_peephole, weight_hr).
    Zoneout: in training each unit keeps its previous value with probability z (a fresh mask);
    otherwise the expectation z * prev + (1 - z) * new. ``recurrent_mask`` (B, P) multiplies h
    before W_hh (recurrent dropout: draw it once per sequence, see :meth:`LSTMCell.recurrent_mask`).
    """
    if mode == "RNN":  # (no options: torch's kernel, on h times the recurrent mask where one is given)
        cell = torch._VF.rnn_tanh_cell if nonlinearity == "tanh" else torch._VF.rnn_relu_cell
        h = states[0] if recurrent_mask is None else states[0] * recurrent_mask
        return (cell(x, h, params["weight_ih"], params["weight_hh"], params.get("bias_ih"), params.get("bias_hh")),)
    if options.plain and "weight_hr" not in params and recurrent_mask is None:
        args = (params["weight_ih"], params["weight_hh"], params.get("bias_ih"), params.get("bias_hh"))
        if mode == "LSTM":
            return tuple(torch._VF.lstm_cell(x, states, *args))
        return (torch._VF.gru_cell(x, states[0], *args),)
    if ops_lib.serves(x) and _on_operator(mode, x):  # no autograd: the layer's C++ operator
        # over one step (the C kernels' backend: a forced "reference" keeps the equations below)
        return _step_on_operator(mode, x, states, params, options, training, recurrent_mask)
    if _gpu_cell.serves(mode, x, recurrent_mask):
        return _gpu_cell.step(mode, x, states, params, options, training, recurrent_mask)  # the Triton step kernels
    if not torch.compiler.is_compiling() and (transformed() or forced() is not None):
        select(mode.lower(), x)  # the equations below: a forced backend that cannot run this call refuses
        # it (under a torch.func transform, any but the reference), as the layers' calls do; under a
        # transform the layer family's warning
    mm = _precision.Products.of(x)
    h_in = states[0] * recurrent_mask if recurrent_mask is not None else states[0]
    if mode == "LSTM":
        new = lstm_cell_step(x, h_in, states[1], params, options, mm)
    else:
        new = (gru_cell_step(x, states[0], params, options, h_in, mm),)
    out = []
    for z, old, upd in zip(options.zoneout, states, new):
        if z:
            keep = keep_mask(upd.shape, z, upd.dtype, upd.device) if training else z
            upd = keep * old.to(upd.dtype) + (1 - keep) * upd
        out.append(upd.to(mm.low))
    return tuple(out)


def _on_operator(mode: str, x: Tensor) -> bool:
    """Whether a call that :func:`fastlayers._native.ops_lib.serves` runs on the operator: the backend
    choice for it is the C kernels (a forced other backend goes through :func:`select`, which may
    refuse it)."""
    op = mode.lower()
    return cpu_kernels(op, x) or select(op, x) == "cpu"


def _step_on_operator(mode: str, x: Tensor, states: tuple[Tensor, ...], params: dict[str, Tensor],
                      options: CellOptions, training: bool, recurrent_mask: Tensor | None) -> tuple[Tensor, ...]:
    """:func:`step` as one call of the layer operator (``torch.ops.fastlayers.lstm_padded`` /
    ``gru_padded``, :mod:`._ops_export`) over T = 1, D = 1 (the parameters as they are: the operator
    takes one direction without its leading 1): the engine's fused C step kernel, the same
    equations; training zoneout draws its keep-masks here."""
    get = params.get
    xt, batch = x.unsqueeze(0), x.size(0)
    z_h, z_c = options.zoneout

    def keep(z: float, width: int) -> Tensor | None:
        return keep_mask((1, 1, batch, width), z, x.dtype, x.device) if training and z else None

    with torch._C._AutoDispatchBelowAutograd():  # (serves(): never under torch.compile)
        if mode == "LSTM":
            zh = keep(z_h, states[0].size(1))  # h's mask first, then c's, as the equations draw them
            zc = keep(z_c, states[1].size(1))
            _, h, c = torch.ops.fastlayers.lstm_padded.default(
                xt, None, states[0].unsqueeze(0), states[1].unsqueeze(0), params["weight_ih"], params["weight_hh"],
                get("bias_ih"), get("bias_hh"), get("ln_ih_weight"), get("ln_hh_weight"), get("ln_cell_weight"),
                get("ln_cell_bias"), get("weight_peephole"), get("weight_hr"), recurrent_mask, zc, zh,
                float(options.cell_clip or 0.0),
                0.0 if training else float(z_c), 0.0 if training else float(z_h), float(options.proj_clip or 0.0))
            return h[0], c[0]
        _, h = torch.ops.fastlayers.gru_padded.default(
            xt, None, states[0].unsqueeze(0), params["weight_ih"], params["weight_hh"], get("bias_ih"), get("bias_hh"),
            get("ln_ih_weight"), get("ln_hh_weight"), recurrent_mask, keep(z_h, states[0].size(1)),
            0.0 if training else float(z_h))
    return (h[0],)


# every parameter a cell can have: torch's cells' and the options' (see _register_options)
_PARAMETER_NAMES = ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr", "ln_ih_weight", "ln_hh_weight",
                    "ln_cell_weight", "ln_cell_bias", "weight_peephole")


class _Cell(NotScriptable):
    """Validation, options and the shared step of the three cells (mixed into torch's classes)."""

    mode: str
    input_size: int
    hidden_size: int
    options: CellOptions
    training: bool
    weight_ih: Tensor

    def _state_sizes(self) -> tuple[int, ...]:
        return (self.hidden_size,)

    def _params(self) -> dict[str, Tensor]:
        """The step's parameters by name, as the module holds them now: a registered Parameter; a
        tensor that torch.nn.utils.prune or the hook-based weight_norm / spectral_norm set as a
        plain attribute in their forward pre-hook (the Parameter is then ``<name>_orig`` / ``_g``,
        ``_v``); a buffer (a weight frozen as ``register_buffer``, as torch.nn's cells read it); or
        a torch.nn.utils.parametrize one, computed at each access."""
        params = self._parameters  # type: ignore[attr-defined]  (nn.Module's own dicts: no per-call walk)
        buffers = self._buffers  # type: ignore[attr-defined]
        plain = self.__dict__
        parametrized = self._modules.get("parametrizations")  # type: ignore[attr-defined]
        found = {}
        for name in _PARAMETER_NAMES:
            p = params.get(name)
            if p is None:
                p = buffers.get(name)
            if p is None:
                p = plain.get(name)
                if p is None and parametrized is not None and name in parametrized:
                    p = getattr(self, name)
            if p is not None:
                found[name] = p
        return found

    def forward(self, input: Any, hx: Any = None, *, recurrent_mask: Tensor | None = None) -> Any:
        """One step: ``input`` (B, F) or unbatched (F,); ``hx`` the state (B, P) (LSTMCell: the pair
        ``(h, c)``, c (B, H)), zeros if None; ``recurrent_mask`` (B, P) from :meth:`recurrent_mask`
        (the same for every step of a sequence) or None. Returns the next state in the input's
        dtype: h (B, P) (LSTMCell: ``(h, c)``). Errors as torch.nn's cells (the class docstring)."""
        if twice.grad_mode_in_inference_mode():
            with torch.no_grad():
                return _Cell.forward(self, input, hx, recurrent_mask=recurrent_mask)
        # torch's cells never read self.training; ours only where an option draws masks in training
        training = any(self.options.zoneout) and self.training
        return cell_step(f"{self.mode}Cell", self.mode, input, hx, self._params(), self.options,
                         input_size=self.input_size, sizes=self._state_sizes(), bias=self.bias,
                         training=training, recurrent_mask=recurrent_mask,
                         nonlinearity=self.nonlinearity if self.mode == "RNN" else "tanh")

    def recurrent_mask(self, batch: int) -> Tensor | None:
        """One recurrent-dropout mask (batch, P) for a whole sequence: Bernoulli(1 - p) / (1 - p) in
        training with ``recurrent_dropout=p > 0``, else None (always None for RNNCell, which has no
        ``recurrent_dropout`` option: pass a (B, H) mask of your own as ``recurrent_mask=``). Pass
        it to every step of the sequence."""
        p = self.options.recurrent_dropout
        if not (self.training and p > 0):
            return None
        w = self.weight_ih
        return keep_mask((batch, self._state_sizes()[0]), 1 - p, w.dtype, w.device) / (1 - p)

    def _register_options(self, options: CellOptions, proj_size: int = 0) -> None:
        self.options = options
        factory = {"device": self.weight_ih.device, "dtype": self.weight_ih.dtype}
        gates = self.weight_ih.size(0)
        hidden = self.hidden_size
        if proj_size:  # h has P features: W_hh (G, P) and the projection W_hr (P, H), as torch.nn.LSTM's
            self.weight_hh = nn.Parameter(torch.empty(gates, proj_size, **factory))
            self.weight_hr = nn.Parameter(torch.empty(proj_size, hidden, **factory))
        if options.layer_norm:
            self.ln_ih_weight = nn.Parameter(torch.empty(gates, **factory))
            self.ln_hh_weight = nn.Parameter(torch.empty(gates, **factory))
            if self.mode == "LSTM":
                self.ln_cell_weight = nn.Parameter(torch.empty(hidden, **factory))
                self.ln_cell_bias = nn.Parameter(torch.empty(hidden, **factory))
        if options.peephole:
            self.weight_peephole = nn.Parameter(torch.empty(3 * hidden, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torch.nn's cell rule, uniform(-1/sqrt(H), 1/sqrt(H)), for every weight and bias (and
        peephole); LayerNorm gains 1 and the cell LayerNorm bias 0. With the options off, the
        parameters torch.nn's cell draws after the same ``torch.manual_seed``."""
        if getattr(self, "options", None) is None:
            return  # torch's __init__: the option parameters are not registered yet
        super().reset_parameters()  # type: ignore[misc]
        init_layer_norm(self)

    def extra_repr(self) -> str:
        extra = super().extra_repr()  # type: ignore[misc]
        opts = self.options.changed()
        if self.mode == "GRU" and "zoneout" in opts:
            opts["zoneout"] = self.options.zoneout[0]
        return extra + "".join(f", {k}={v!r}" for k, v in opts.items())


def init_layer_norm(module: nn.Module) -> None:
    """LayerNorm gains 1 and cell LayerNorm biases 0, in the tensors the module stores: the
    Parameter itself, a pruned one's ``<name>_orig``, a parametrized one's
    ``parametrizations.<name>.original`` (torch's ``reset_parameters`` draws those too)."""
    with torch.no_grad():
        for path, p in module.named_parameters():
            parts = path.split(".")
            name = parts[1] if parts[0] == "parametrizations" and len(parts) == 3 else parts[-1].removesuffix("_orig")
            if name.startswith("ln_"):
                p.fill_(0.0 if name.startswith("ln_cell_bias") else 1.0)


_OPTIONS_DOC = """; float32 under ``torch.autocast`` runs the low-precision rule of
    :mod:`fastlayers._core.precision` when an option is on). Options off: torch's cell kernel,
    exactly torch.nn.{name}. Options on: the fastlayers engine's step equations (see
    :class:`fastlayers.{layer}`), the same function as ``fastlayers.{layer}(...).cell(layer,
    direction)``; on CUDA in float32 / float64 the layers' Triton step kernel (forward and
    backward, one launch each beside torch's GEMMs)."""
_CELL_DOC = """
    Shape legend: B batch, F = input_size, H = hidden_size, P = proj_size if proj_size > 0 else H
    (the h size: LSTMCell's projection; P = H for GRUCell and RNNCell).

    Forward: ``forward(input, hx=None, *, recurrent_mask=None)``; ``input`` (B, F) or unbatched
    (F,); {forward_doc} ``recurrent_mask`` (B, P) or None multiplies h before W_hh (recurrent
    dropout: one mask for every step of a sequence). Dtype: that of the parameters (float32, float64,
    bfloat16, float16{kernels}

    Errors: for every input torch.nn.{name} rejects, an instance of torch's class whose message
    starts with torch's message for it (its Python checks, then its kernel's: ``input has
    inconsistent input_size``, ``hidden0 has inconsistent hidden_size``, ``mat1 and mat2 must have
    the same dtype``, without biases ``expected m1 and m2 to have the same dtype``), then ``"; "``
    and our details, checked in torch's order (sizes before dtype):
    TypeError and AttributeError for a non-tensor input or state (TypeError, IndexError,
    RuntimeError and AttributeError for an LSTM state that is not a pair); RuntimeError for an
    RNNCell nonlinearity other than ``"tanh"`` or ``"relu"`` (torch's check at the call); TypeError, ValueError
    and RuntimeError for an input dtype other than the parameters' or an integer input; ValueError
    for an input or state of rank other than 1 or 2; ValueError and RuntimeError for a feature size
    other than input_size or a state of the wrong shape (IndexError too for a 1-D state beside a
    batched input of as many rows as H, torch's "Dimension out of range"); TypeError and RuntimeError for a state of
    another dtype (LSTMCell's c included, which torch.nn.LSTMCell mixes in silently). The module
    reads ``self.training`` only with zoneout (as torch's cells, which never read it).
"""


def cell_step(name: str, mode: str, input: Any, hx: Any, params: dict[str, Tensor], options: CellOptions, *,
              input_size: int, sizes: tuple[int, ...], bias: bool, training: bool = False,
              recurrent_mask: Tensor | None = None, nonlinearity: str = "tanh") -> Any:
    """One checked step of a cell ``name`` (``"LSTMCell"``, ``"GRUCell"``, ``"RNNCell"``) on the
    parameters ``params``, as torch.nn's cell runs it: validation with torch's errors; under
    autocast an autocast layer's bf16 activation taken by float32 parameters, a float32 one by
    bf16 / fp16 parameters (then the low-precision model's step, autocast off); :func:`step`,
    unbatched results squeezed, results in torch's cell's dtype. Shared by the cells and
    ``LSTM/GRU.cell()``'s views."""
    given = input, hx
    weight_dtype = params["weight_ih"].dtype
    autocast_off = False
    if isinstance(input, Tensor) and _precision.autocasting(input.device.type):
        # an autocast layer's bf16 output (or state) to float32 parameters, a float32 one to bf16
        # parameters: as torch.nn's cells take them
        input, hx = _precision.autocast_operand(input, weight_dtype), _precision.autocast_operand(hx, weight_dtype)
        autocast_off = _precision.autocast_off_for(input.device.type, weight_dtype)
    x, states, batched = check_cell(name, mode, input, hx, input_size=input_size, weight_dtype=weight_dtype,
                                    sizes=sizes, bias=bias)
    if not options.plain:  # (torch's kernels refuse the plain cells' mixed parameters)
        check_parameter_dtypes(params, weight_dtype, "weight_ih")
    if recurrent_mask is not None:
        recurrent_mask = check_mask("recurrent_mask", recurrent_mask, batched, x.size(0), sizes[0], x)
    if mode == "RNN" and nonlinearity not in ("tanh", "relu"):  # torch.nn.RNNCell checks it per call
        raise RuntimeError(f"Unknown nonlinearity: {nonlinearity}; nonlinearity: expected 'tanh' or "
                           f"'relu', got {nonlinearity!r}")
    # low-precision parameters under autocast: the low-precision model's step, autocast off
    with torch.autocast(x.device.type, enabled=False) if autocast_off else contextlib.nullcontext():
        new = step(mode, x, states, params, options, training=training, recurrent_mask=recurrent_mask,
                   nonlinearity=nonlinearity)
    new = new if batched else tuple(s.squeeze(0) for s in new)
    if (input is not given[0] or hx is not given[1]) and mode != "RNN" and options.plain:
        out = _autocast_result(mode, *given)  # converted for autocast: torch's cell's result dtype
        new = tuple(s.to(out) for s in new)
    return new if mode == "LSTM" else new[0]


def _autocast_result(mode: str, input: Tensor, hx: Any) -> torch.dtype:
    """The dtype torch.nn's LSTMCell / GRUCell return under autocast: its gates come out of the
    autocast products, then the step adds the given state (LSTM: c, GRU: h) to them, so the result
    takes that state's dtype (the input's when no state is given, as its zeros)."""
    if hx is None:
        return input.dtype
    return (hx[1] if mode == "LSTM" else hx).dtype


class LSTMCell(_Cell, nn.LSTMCell):
    __doc__ = (
        "LSTM cell (Hochreiter & Schmidhuber 1997) as :class:`torch.nn.LSTMCell`, plus the cell options "
        "of :class:`fastlayers.LSTM` (keyword-only: ``proj_size``, ``layer_norm``, ``peephole``, "
        "``cell_clip``, ``zoneout``, ``recurrent_dropout``, ``proj_clip``; same equations and "
        "parameter names without the ``_l{k}`` suffix).\n"
        + _CELL_DOC.format(name="LSTMCell", forward_doc=(
            "``hx`` = (h (B, P), c (B, H)), zeros if omitted. Returns (h_1, c_1)."),
            kernels=_OPTIONS_DOC.format(name="LSTMCell", layer="LSTM"))
    )

    mode = "LSTM"

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, device=None, dtype=None, *,
                 proj_size: int = 0, layer_norm: bool = False, peephole: bool = False, cell_clip: float | None = None,
                 zoneout: float | tuple[float, float] | None = None, recurrent_dropout: float = 0.0,
                 proj_clip: float | None = None) -> None:
        options = CellOptions.make(layer_norm, peephole, cell_clip, zoneout, recurrent_dropout, proj_clip)
        if isinstance(proj_size, bool) or not isinstance(proj_size, int) or proj_size != 0 and not \
                0 < proj_size < hidden_size:  # (0 whatever hidden_size is: torch's constructor then checks it)
            raise ValueError(f"proj_size: expected an int in [0, hidden_size = {hidden_size}), got {proj_size!r}")
        if options.proj_clip is not None and proj_size == 0:
            raise ValueError(f"proj_clip: clips the projection, so it needs proj_size > 0; got proj_clip="
                             f"{options.proj_clip} with proj_size=0")
        super().__init__(input_size, hidden_size, bias, device, dtype)
        self.proj_size = proj_size
        self._register_options(options, proj_size)

    def _state_sizes(self) -> tuple[int, ...]:
        return (self.proj_size or self.hidden_size, self.hidden_size)

    def extra_repr(self) -> str:
        extra = super().extra_repr()
        if not self.proj_size:
            return extra
        head, _, tail = extra.partition(", ")  # "F, H, ..." -> "F, H, proj_size=P, ..."
        size, _, rest = tail.partition(", ")
        return ", ".join(part for part in (head, size, f"proj_size={self.proj_size}", rest) if part)


class GRUCell(_Cell, nn.GRUCell):
    __doc__ = (
        "GRU cell (Cho et al. 2014, torch's form) as :class:`torch.nn.GRUCell`, plus the cell options of "
        ":class:`fastlayers.GRU` (keyword-only: ``layer_norm``, ``zoneout``, ``recurrent_dropout``).\n"
        + _CELL_DOC.format(name="GRUCell", forward_doc="``hx`` h (B, H), zeros if omitted. Returns h_1.",
                           kernels=_OPTIONS_DOC.format(name="GRUCell", layer="GRU"))
    )

    mode = "GRU"

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, device=None, dtype=None, *,
                 layer_norm: bool = False, zoneout: float | None = None, recurrent_dropout: float = 0.0) -> None:
        options = CellOptions.make_gru(layer_norm, zoneout, recurrent_dropout)
        super().__init__(input_size, hidden_size, bias, device, dtype)
        self._register_options(options)


class RNNCell(_Cell, nn.RNNCell):
    __doc__ = (
        "Elman RNN cell (Elman 1990) with tanh or ReLU nonlinearity as :class:`torch.nn.RNNCell` (torch's kernel; "
        "fastlayers' validation; a recurrent-dropout mask).\n"
        + _CELL_DOC.format(name="RNNCell", forward_doc="``hx`` h (B, H), zeros if omitted. Returns h_1.",
                           kernels=("). No cell options: torch's cell kernel, exactly torch.nn.RNNCell (on h "
                                    "times ``recurrent_mask`` where one is given)."))
    )

    mode = "RNN"

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, nonlinearity: str = "tanh", device=None,
                 dtype=None) -> None:
        super().__init__(input_size, hidden_size, bias, nonlinearity, device, dtype)
        self._register_options(CellOptions())


__all__ = ["LSTMCell", "GRUCell", "RNNCell"]
