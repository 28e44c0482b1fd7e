"""Drop-in torch.nn.LSTM / GRU / RNN with a per-sequence ``lengths`` argument.

The classes subclass the torch modules, so constructor arguments, parameter names
(``weight_ih_l{k}{_reverse}``, ...), ``state_dict`` and the forward contract without lengths
(padded Tensor, unbatched 2-D, PackedSequence, ``hx``) are torch's own, running torch's kernels.
``forward(input, hx=None, *, lengths=None)`` adds the lengths path (:mod:`._varlen`), and
``LSTM(..., layer_norm=, peephole=, cell_clip=, zoneout=, recurrent_dropout=)`` adds cell options,
run by the engine (:mod:`._cpu` on CPU, :mod:`._gpu` on CUDA; :mod:`._reference`
where neither runs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from .._core import jagged, twice
from .._core import precision as _precision
from .._core.checks import as_lengths
from .._core.jit import ENGINE, VARLEN, NotScriptable, refuse_trace
from .._native import ops_lib
from .._core.backend import batched_or_forward_mode, select, transformed
from ._cells import cell_step, init_layer_norm
from ._docs import COMMON_DOC, GRU_OPTIONS_DOC, OPTIONS_DOC
from ._lengths import varlen_rows
from ._ops_export import operator_layers
from ._ops_varlen import varlen_operator_layers
from . import _gpu_graphs
from ._options import CellOptions
from ._reference import reference_varlen_rnn
from ._remat import check_every, checkpointed
from ._routing import ENGINES
from ._validate import check_layer, check_parameter_dtypes, check_parameters_device
from ._varlen import varlen_rnn

class _LengthsMixin(NotScriptable):
    """Validation and lengths dispatch shared by LSTM, GRU and RNN (mixed into torch's classes)."""

    _TRACES = "torch.jit.trace works without cell options and lengths"

    mode: str
    input_size: int
    hidden_size: int
    num_layers: int
    bidirectional: bool
    batch_first: bool
    bias: bool
    dropout: float
    training: bool
    _flat_weights: list[Tensor]

    def _state_sizes(self) -> tuple[int, ...]:
        proj = getattr(self, "proj_size", 0)
        if self.mode == "LSTM":
            return (proj or self.hidden_size, self.hidden_size)
        return (self.hidden_size,)

    def _zero_states(self, like: Tensor, batch: int) -> tuple[Tensor, ...]:
        """The initial states of a call without ``hx``: zeros (L*D, B, size) of ``like``'s dtype and
        device, one per state (LSTM: h (P) and c (H))."""
        layers = self.num_layers * (2 if self.bidirectional else 1)
        return tuple(like.new_zeros(layers, batch, size) for size in self._state_sizes())

    def _check_args(self, input: object, hx: object) -> tuple[Tensor, tuple[Tensor, ...] | None]:
        """(input, hx as batched 3-D states or None), or torch.nn's error for the same call (see
        :mod:`._validate`)."""
        batch = 1
        if isinstance(input, Tensor) and input.dim() == 3:
            batch = input.size(0 if self.batch_first else 1)
        layers = self.num_layers * (2 if self.bidirectional else 1)
        expected = tuple((layers, batch, size) for size in self._state_sizes())
        if isinstance(input, Tensor) and input.dtype != self._flat_weights[0].dtype:
            self._update_flat_weights()  # type: ignore[attr-defined]  (functional_call's tensors: see _run)
        checked = check_layer("RNN" if self.mode.startswith("RNN") else self.mode, input, hx,
                              input_size=self.input_size, weight_dtype=self._flat_weights[0].dtype, expected=expected)
        check_parameters_device(checked[0], self._flat_weights[0])
        return checked

    def _autocast_operands(self, input: Any, hx: Any) -> tuple[Any, Any]:
        """(input, hx) converted where autocast is on: a low-precision activation to float32
        parameters' float32, a float32 one to bfloat16 / float16 parameters' dtype
        (:func:`fastlayers._core.precision.autocast_operand`)."""
        if not self._flat_weights or self._flat_weights[0] is None:
            return input, hx
        weight = self._flat_weights[0].dtype
        return _precision.autocast_operand(input, weight), _precision.autocast_operand(hx, weight)

    def _autocast_off(self, input: Any) -> str | None:
        """The device type whose autocast a call of bfloat16 / float16 parameters turns off (under
        autocast: :func:`fastlayers._core.precision.autocast_off_for`), else None."""
        data = input.data if isinstance(input, PackedSequence) else input
        if not self._flat_weights or self._flat_weights[0] is None or not isinstance(data, Tensor):
            return None
        device = data.device.type
        return device if _precision.autocast_off_for(device, self._flat_weights[0].dtype) else None

    def _engine_precision(self, input: Tensor) -> bool:
        # torch's CPU LSTM kernel under bf16 autocast needs oneDNN's bf16 LSTM (AVX512-BF16 CPUs; it
        # fails elsewhere) and with bf16 parameters keeps the cell state in bf16: the engine (or its
        # per-step reference; RNN: torch's float32 kernels on rounded operands) keeps it in float32 on every CPU
        return input.device.type == "cpu" and _precision.is_low(input)

    def _options_plain(self) -> bool:
        return True

    def _engine_backend(self, input: Tensor) -> str | None:
        """The backend ("cpu", "triton", "reference") of the fastlayers engine when it runs this call
        with or without lengths, else None: torch's kernel without lengths, and with lengths
        :meth:`_run` decides. LSTM and GRU only, see :class:`_CellOptionsMixin`."""
        return None

    def forward(self, input: Any, hx: Any = None, *, lengths: Any = None, cu_seqlens: Any = None,
                max_seqlen: Any = None) -> Any:
        """Run every layer over the sequence: ``input`` (T, B, F), (B, T, F) with ``batch_first``,
        unbatched (T, F) or a PackedSequence; ``hx`` the initial state (L*D, B, P) (LSTM: the pair
        ``(h_0, c_0)``, c (L*D, B, H)), zeros if None; ``lengths`` (B,) integers in [1, T] (tensor on
        any device, or a list), the packed semantics on the padded batch. Returns ``(output, h_n)``
        (LSTM: ``(output, (h_n, c_n))``), output (T, B, D*P) (or (B, T, D*P)) in the input's dtype,
        zero at t >= lengths[b]. Shapes, devices and the errors raised: the class docstring.

        Without padding (the varlen form, as flash-attention's ``cu_seqlens``): ``input`` (N, F),
        the B sequences one after another, ``cu_seqlens`` (B+1,) int32 / int64 (0, then the running
        sum of the lengths, ending at N; on the input's device or the CPU), ``max_seqlen`` an
        optional int >= the longest length; the output is (N, D*P) in the same layout, h_n (c_n) as
        with ``lengths``; ``batch_first`` does not apply. A jagged NestedTensor (B, j, F) as
        ``input`` runs the same way and returns a jagged (B, j, D*P) output with its offsets.
        ValueError / TypeError for a bad ``cu_seqlens`` (not starting at 0, decreasing, a sequence
        of length 0, not ending at N, another dtype or device), ``cu_seqlens`` with ``lengths``,
        a strided nested tensor or ragged features (:mod:`fastlayers._core.jagged`).

        Under ``torch.autocast`` a bfloat16 / float16 ``input`` or state reaching float32
        parameters (an autocast layer's output) runs as the float32 call (as torch.nn's modules
        take it); outputs in the autocast dtype."""
        if twice.grad_mode_in_inference_mode():
            with torch.no_grad():
                return _LengthsMixin.forward(self, input, hx, lengths=lengths, cu_seqlens=cu_seqlens,
                                             max_seqlen=max_seqlen)
        input, hx = self._autocast_operands(input, hx)
        autocast_off = self._autocast_off(input)
        if autocast_off is not None:  # low-precision parameters: the low-precision model's call
            with torch.autocast(autocast_off, enabled=False):
                return _LengthsMixin.forward(self, input, hx, lengths=lengths, cu_seqlens=cu_seqlens,
                                             max_seqlen=max_seqlen)
        given = input, hx
        if isinstance(input, Tensor) and input.is_nested:
            if cu_seqlens is not None or lengths is not None:
                raise ValueError("cu_seqlens, lengths: expected None for a NestedTensor input (it carries its offsets)")
            values, offsets = jagged.unwrap("input", input)
            output, final = self._forward_varlen(values, hx, offsets, max_seqlen)
            return jagged.rewrap(output, offsets), final
        if cu_seqlens is not None:
            if lengths is not None:
                raise ValueError("lengths: expected None with cu_seqlens (the varlen form carries its lengths)")
            if isinstance(input, PackedSequence):
                raise ValueError("cu_seqlens: expected None for PackedSequence input (it carries its own lengths)")
            return self._forward_varlen(input, hx, cu_seqlens, max_seqlen)
        if max_seqlen is not None:
            raise ValueError("max_seqlen: expected None without cu_seqlens")
        if isinstance(input, PackedSequence):
            if lengths is not None:
                raise ValueError("lengths: expected None for PackedSequence input (it carries its own lengths)")
            if not self._options_plain() or self._engine_precision(input.data):  # (a low-precision call on
                return self._forward_packed(input, hx)  # CPU: the engine's rule, as the other forms run it)
            return super().forward(*given)  # type: ignore[misc]  (torch's own)
        exporting = torch.compiler.is_exporting()  # every layer one operator (._ops_export): T and B stay dynamic
        # an input that _check_args passes as it is: the backend is decided first (once), and the plain
        # call goes straight to torch's forward
        common = (lengths is None and hx is None and not exporting and type(input) is Tensor and input.dim() == 3
                  and input.size(2) == self.input_size and input.dtype == self._flat_weights[0].dtype)
        engine = self._engine_backend(input) if common else None
        if common and engine is None:
            return super().forward(input)  # type: ignore[misc]
        if lengths is not None and torch.compiler.is_compiling() and not exporting:
            from .._core.compiling import eagerly  # one graph break: the plan reads the lengths on the host

            return eagerly(self.forward, input, hx, lengths=lengths)
        input, states = self._check_args(input, hx)
        time_dim = 1 if self.batch_first and input.dim() == 3 else 0
        if exporting:  # T is a symbol there, which tracing takes as >= 2: an assertion the exported program runs
            torch._assert_async(torch.scalar_tensor(input.size(time_dim)) > 0,
                                "Expected sequence length to be larger than 0 in RNN")
        elif input.size(time_dim) == 0:  # torch.nn's RNNs raise this (their kernel's message)
            raise RuntimeError("Expected sequence length to be larger than 0 in RNN")
        if input.dim() == 3 and input.size(1 - time_dim) == 0 and not exporting:
            return self._empty_batch(input, states, lengths)
        if not common:
            engine = None if exporting else self._engine_backend(input)  # decided once per call, passed on to _run
        if lengths is None and engine is None and not exporting:
            return super().forward(input, hx)  # type: ignore[misc]
        refuse_trace(f"fastlayers.{type(self).__name__} with {'lengths' if lengths is not None else 'cell options'}",
                     ENGINE)
        batched = input.dim() == 3
        x = input if batched else input.unsqueeze(1 if not self.batch_first else 0)
        time_dim = 1 if self.batch_first else 0
        steps, batch = x.size(time_dim), x.size(1 - time_dim)
        if lengths is not None:
            lengths = as_lengths(lengths, batch, steps)
        if states is None:
            states = self._zero_states(x, batch)
        output, final = operator_layers(self, x, states, lengths) if exporting else self._run(x, states, lengths, engine)
        if not batched:
            output = output.squeeze(time_dim ^ 1)
            final = tuple(s.squeeze(1) for s in final)
        return output, (final if self.mode == "LSTM" else final[0])

    def _empty_batch(self, x: Tensor, states: tuple[Tensor, ...] | None, lengths: Any) -> Any:
        """A batch of no sequences (B = 0), as torch.nn returns it: output (T, 0, D * H_out) and states
        (L * D, 0, H) of zeros, on the autograd graph (the parameters' gradients are zeros). The
        plain-PyTorch reference computes it for every cell option (nothing runs per row)."""
        time_dim = 1 if self.batch_first else 0
        if lengths is not None:
            as_lengths(lengths, 0, x.size(time_dim))  # still validated: a (0,) integer tensor or list
        if self.mode not in ("LSTM", "GRU"):
            return super().forward(x, states[0] if states is not None else None)  # type: ignore[misc]
        if states is None:
            states = self._zero_states(x, 0)
        impl = ENGINES[self.mode, "reference"]
        xt = x.transpose(0, 1) if self.batch_first else x
        out, final = impl(xt, states, self._layer_parameters(), None, self.options, dropout=self.dropout,
                          training=self.training)
        out = out.transpose(0, 1) if self.batch_first else out
        return out, (final if self.mode == "LSTM" else final[0])

    def _forward_varlen(self, values: Any, hx: Any, cu_seqlens: Any, max_seqlen: Any) -> Any:
        """The varlen form (N, F) + cu_seqlens through the padded path with lengths: one index_copy
        in, one index_select out (exact; :mod:`fastlayers._core.jagged`). While torch.compile or
        torch.export traces: one operator per layer (:mod:`._ops_varlen`), no graph break; under
        torch.jit.trace one RuntimeError naming torch.export."""
        refuse_trace(f"fastlayers.{type(self).__name__}'s varlen form", VARLEN)
        if not isinstance(values, Tensor):
            raise TypeError(f"input: expected a Tensor of shape (N, F) with cu_seqlens, got {type(values).__name__}")
        if values.dim() != 2:
            raise ValueError(f"input: expected a 2-D tensor (N, F) with cu_seqlens (the sequences one after another), "
                             f"got shape {tuple(values.shape)}")
        if torch.compiler.is_compiling():  # traced: one operator per layer, no graph break (._ops_varlen)
            jagged.check_form(cu_seqlens, values.device)
            if max_seqlen is not None:
                jagged.check_max_seqlen(max_seqlen, cu_seqlens)
            states = self._varlen_states(values, hx, cu_seqlens.size(0) - 1)
            output, final = varlen_operator_layers(self, values, states, cu_seqlens)
            return output, (final if self.mode == "LSTM" else final[0])
        plan = jagged.varlen(cu_seqlens, values.size(0), values.device, batch_first=self.batch_first,
                             max_seqlen=max_seqlen)
        padded = jagged.pad(values, plan, batch_first=self.batch_first)
        output, final = self.forward(padded, hx, lengths=plan.lengths)
        return jagged.unpad(output, plan), final

    def _varlen_states(self, values: Tensor, hx: Any, batch: int) -> tuple[Tensor, ...]:
        """The initial states of a varlen call of ``batch`` sequences: ``hx`` checked as for a (T, B, F)
        call (features, dtype, device, the states' shapes), else zeros."""
        # one step of that shape (a view of values would guard on batch != 1 under torch.export)
        features = values.size(1)
        view = values.new_empty((batch, 1, features) if self.batch_first else (1, batch, features))
        _, states = self._check_args(view, hx)
        return states if states is not None else self._zero_states(values, batch)

    def _forward_packed(self, packed: PackedSequence, hx: Any) -> Any:
        """A PackedSequence through the lengths path (the cell options have no packed kernel in torch):
        its padded batch and lengths, then the output packed again in the input's sorted order, with
        its batch_sizes and indices, as torch returns it; h_n (c_n) in the original batch order."""
        padded, lengths = pad_packed_sequence(packed, batch_first=self.batch_first)
        output, final = self.forward(padded, hx, lengths=lengths)
        output = output.transpose(0, 1) if self.batch_first else output  # (T, B, D*H_out)
        order = packed.sorted_indices
        if order is not None:
            output, lengths = output.index_select(1, order), lengths.index_select(0, order.cpu())
        data = pack_padded_sequence(output, lengths, enforce_sorted=True).data
        return PackedSequence(data, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices), final

    def _no_padding(self, x: Tensor, lengths: Tensor) -> bool:
        time_dim = 1 if self.batch_first else 0
        return bool(x.size(1 - time_dim)) and bool((lengths == x.size(time_dim)).all())

    def _run(self, x: Tensor, states: tuple[Tensor, ...], lengths: Tensor,
             engine: str | None) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Padded batch (batched, layout per batch_first) + validated lengths -> output, final states
        (``engine``: see :meth:`_engine_backend`; None here, where no engine exists)."""
        if self._no_padding(x, lengths):
            # no padding anywhere: the padded fused call is exactly the packed semantics
            output, final = super().forward(x, states if self.mode == "LSTM" else states[0])  # type: ignore[misc]
            return output, (final if self.mode == "LSTM" else (final,))
        impl = varlen_rnn if x.device.type == "cpu" else reference_varlen_rnn
        # the parameters as this call sees them (torch's forward does the same): torch.func.functional_call
        # and parametrizations put other tensors in their place, which _flat_weights lists only then
        self._update_flat_weights()  # type: ignore[attr-defined]
        return impl(
            x,
            states,
            self._flat_weights,
            lengths,
            mode=self.mode,
            has_biases=self.bias,
            num_layers=self.num_layers,
            bidirectional=self.bidirectional,
            batch_first=self.batch_first,
            dropout=self.dropout,
            training=self.training,
        )


class _CellOptionsMixin:
    """Cell options shared by LSTM and GRU: extra parameters, engine dispatch, step-wise cells."""

    options: CellOptions
    mode: str
    hidden_size: int
    num_layers: int
    bidirectional: bool
    bias: bool
    batch_first: bool
    dropout: float
    training: bool
    proj_size: int

    def _init_options(self, options: CellOptions) -> None:
        """Register the options' parameters, then initialise every parameter once (reset_parameters)."""
        self.options = options
        factory = {"device": self.weight_ih_l0.device, "dtype": self.weight_ih_l0.dtype}  # type: ignore[attr-defined]
        gates = 4 if self.mode == "LSTM" else 3
        for name in self._option_parameter_names():
            size = 3 * self.hidden_size if name.startswith("weight_peephole") else (
                gates * self.hidden_size if name.startswith(("ln_ih", "ln_hh")) else self.hidden_size)
            self.register_parameter(name, nn.Parameter(torch.empty(size, **factory)))  # type: ignore[attr-defined]
        self.reset_parameters()

    def _option_parameter_names(self) -> list[str]:
        names = []
        for layer in range(self.num_layers):
            for sfx in ("", "_reverse")[: 2 if self.bidirectional else 1]:
                if self.options.layer_norm:
                    names += [f"ln_ih_weight_l{layer}{sfx}", f"ln_hh_weight_l{layer}{sfx}"]
                    if self.mode == "LSTM":
                        names += [f"ln_cell_weight_l{layer}{sfx}", f"ln_cell_bias_l{layer}{sfx}"]
                if self.options.peephole:
                    names.append(f"weight_peephole_l{layer}{sfx}")
        return names

    def reset_parameters(self) -> None:
        """Initialise every parameter: torch.nn.LSTM/GRU's rule, uniform(-1/sqrt(H), 1/sqrt(H)), for
        the weights, biases and peephole weights; LayerNorm gains 1 and the cell LayerNorm bias 0.

        Construction calls it once, after the option parameters exist (torch's own call inside
        ``RNNBase.__init__`` comes before them and is skipped), so with options off the module
        draws exactly the parameters torch.nn.LSTM/GRU draws after the same ``torch.manual_seed``.
        """
        if getattr(self, "options", None) is None:
            return  # torch's RNNBase.__init__: the option parameters are not registered yet
        super().reset_parameters()  # type: ignore[misc]  (uniform over every parameter, peepholes included)
        init_layer_norm(self)

    def _options_plain(self) -> bool:
        return self.options.plain and self.checkpoint_every is None

    def _set_checkpoint_every(self, every: Any) -> None:
        self.checkpoint_every = every

    @property
    def checkpoint_every(self) -> int | str | None:
        """Recomputation through time (see the class docstring): None, an int k >= 1 or "auto".
        Settable on the module; a value of another kind raises the constructor's ValueError."""
        state = self.__dict__  # (a module pickled before this was a property holds it as the plain name)
        return state["_checkpoint_every"] if "_checkpoint_every" in state else state.get("checkpoint_every")

    @checkpoint_every.setter
    def checkpoint_every(self, every: Any) -> None:
        self.__dict__["_checkpoint_every"] = check_every("checkpoint_every", every)

    def _recomputes(self) -> bool:
        """Whether this call runs as recomputed segments: checkpoint_every set, gradients recorded,
        not traced by torch.compile, not under a torch.func transform or forward-mode AD (the
        segments' Function has no functorch rules; the call without them computes the same values
        and draws the same masks, holding every step's activations)."""
        return (self.checkpoint_every is not None and twice.graph_recorded() and not torch.compiler.is_compiling()
                and not transformed())

    def _plain_on_engine(self, input: Tensor) -> bool:
        # Measured on an H100 (torch 2.11, fp32 TF32 off, 2 directions, fwd+bwd; BENCHMARKS.md,
        # bench_gpu_engine.py --sweep, 2026-11-24): with its time loops in CUDA graphs the engine took
        # 0.24x (LSTM) / 0.22x (GRU) cuDNN's time at the seed shape (T=800, B=32, H=256), 0.72-0.99x
        # at H=256-1024 with B*H <= 2^17, but 1.22-1.82x at H <= 128 (cuDNN's steps are short there)
        # and 1.18-1.25x at B=256, H=1024 (the step's GEMM dominates); eagerly it took 3.4-3.8x. So:
        # H >= 256 and B*H <= 2^17 with graphs on (not switched off, not inside the caller's own
        # capture, not under torch.compile), and only where this call's loops replay graphs captured
        # already (_gpu.replays: a call that would capture runs on cuDNN while they are
        # captured for the next one); float64 (not measured) stays on cuDNN too. Asked only once the
        # backend is Triton (_engine_backend)
        from ._gpu import replays

        batch = input.size(0 if self.batch_first else 1) if input.dim() == 3 else 1
        return (input.device.type == "cuda" and input.dtype != torch.float64 and self.hidden_size >= 256
                and batch * self.hidden_size <= 2**17 and not torch.compiler.is_compiling()
                and _gpu_graphs.enabled(input) and replays(self, input))

    def _engine_backend(self, input: Tensor) -> str | None:
        # (under vmap or forward-mode AD torch's fused kernels cannot run; the engine's reference can)
        if not self.options.plain or self._engine_precision(input) or self._recomputes() or batched_or_forward_mode():
            return select(self.mode.lower(), input)
        if input.device.type == "cuda" and select(self.mode.lower(), input) == "triton" and \
                self._plain_on_engine(input):  # (the device first: a plain CPU call asks nothing more)
            return "triton"
        return None

    def _layer_parameters(self) -> list[list[dict[str, Tensor]]]:
        keys = ["weight_ih", "weight_hh"] + (["bias_ih", "bias_hh"] if self.bias else [])
        if self.options.layer_norm:
            keys += ["ln_ih_weight", "ln_hh_weight"] + (["ln_cell_weight", "ln_cell_bias"] if self.mode == "LSTM" else [])
        if self.options.peephole:
            keys.append("weight_peephole")
        if getattr(self, "proj_size", 0) > 0:
            keys.append("weight_hr")
        layers = [[{k: getattr(self, f"{k}_l{layer}{sfx}") for k in keys}
                   for sfx in ("", "_reverse")[: 2 if self.bidirectional else 1]] for layer in range(self.num_layers)]
        self._check_parameter_shapes(layers)
        return layers

    def _check_parameter_shapes(self, layers: list[list[dict[str, Tensor]]]) -> None:
        """RuntimeError naming the parameter whose shape is not the module's (a tensor given by
        torch.func.functional_call, or a parameter's .data replaced): the engines' kernels read the
        shapes the module says, so another one would be read past its end; or whose dtype is not
        weight_ih_l0's (torch.nn's layers refuse one; the engines converted it silently)."""
        dtype = layers[0][0]["weight_ih"].dtype
        g, h = (4 if self.mode == "LSTM" else 3) * self.hidden_size, self.hidden_size
        p = getattr(self, "proj_size", 0) or h
        shapes = {"weight_hh": (g, p), "bias_ih": (g,), "bias_hh": (g,), "ln_ih_weight": (g,), "ln_hh_weight": (g,),
                  "ln_cell_weight": (h,), "ln_cell_bias": (h,), "weight_peephole": (3 * h,), "weight_hr": (p, h)}
        for layer, directions in enumerate(layers):
            shapes["weight_ih"] = (g, self.input_size if layer == 0 else len(directions) * p)  # type: ignore[attr-defined]
            for sfx, params in zip(("", "_reverse"), directions):
                check_parameter_dtypes(params, dtype, "weight_ih_l0", f"_l{layer}{sfx}")
                for key, t in params.items():
                    if t.shape != shapes[key]:
                        raise RuntimeError(f"{key}_l{layer}{sfx}: expected shape {shapes[key]}, got {tuple(t.shape)} "
                                           f"(the parameters of fastlayers.{type(self).__name__}({self.extra_repr()}))")

    def _run(self, x: Tensor, states: tuple[Tensor, ...], lengths: Tensor | None, engine: str | None):
        # engine None: a plain call with lengths (forward ran the others without lengths on torch's
        # kernels). The engine's C kernels run it where they run (they skip padding in every GEMM
        # and beat the segment path, see BENCHMARKS.md); torch's kernels when nothing is padded, or
        # on the reference backend (segments on CPU), or on CUDA (PackedSequence on cuDNN) where the
        # Triton engine's loops are not captured (_plain_on_engine)
        if engine is None:
            which = select(self.mode.lower(), x)
            if which != "cpu" or self._no_padding(x, lengths):  # type: ignore[attr-defined]
                return super()._run(x, states, lengths, None)  # type: ignore[misc]
            engine = which
        if engine == "cpu" and ops_lib.serves(x):  # no autograd: one C++ operator per layer (._ops_export)
            return operator_layers(self, x, states, lengths)
        impl = ENGINES[self.mode, engine]
        xt = x.transpose(0, 1) if self.batch_first else x
        if self._recomputes():
            out, final = checkpointed(impl, self.checkpoint_every, xt, states, self._layer_parameters(), lengths,
                                      self.options, dropout=self.dropout, training=self.training, cell=self.mode)
        else:
            out, final = impl(xt, states, self._layer_parameters(), lengths, self.options, dropout=self.dropout,
                              training=self.training)
        return (out.transpose(0, 1) if self.batch_first else out), final

    def _forward_varlen(self, values: Any, hx: Any, cu_seqlens: Any, max_seqlen: Any) -> Any:
        """The varlen form on the C engine (its packed rows read from and written to the (N, ...)
        layout directly; with ``checkpoint_every``, its segments too) and, for a layer with cell
        options, on the Triton engine (its buffers sized by the N value rows): no padded tensor,
        memory follows N, not B x T. Elsewhere (the reference backend, plain layers off the C engine,
        recomputation off the C engine) through the padded path, and traced through the varlen
        operators (:meth:`_LengthsMixin._forward_varlen`); torch.jit.trace is refused there."""
        refuse_trace(f"fastlayers.{type(self).__name__}'s varlen form", VARLEN)
        backend = select(self.mode.lower(), values) if isinstance(values, Tensor) else None
        on_engine = backend == "cpu" or (backend == "triton" and (not self.options.plain
                                                                  or self._engine_precision(values)))
        recomputes = self._recomputes()
        if not (isinstance(values, Tensor) and values.dim() == 2 and values.size(0) > 0) \
                or torch.compiler.is_compiling() or not on_engine \
                or (recomputes and (backend != "cpu" or torch.jit.is_tracing())):
            return super()._forward_varlen(values, hx, cu_seqlens, max_seqlen)  # type: ignore[misc]
        lengths, rows = varlen_rows(backend, cu_seqlens, values.size(0), values.device, max_seqlen)
        states = self._varlen_states(values, hx, lengths.numel())  # type: ignore[attr-defined]
        if recomputes:  # the segments on the values' rows
            out, final = checkpointed(ENGINES[self.mode, backend], self.checkpoint_every, values, states,
                                      self._layer_parameters(), lengths, self.options, dropout=self.dropout,
                                      training=self.training, cell=self.mode, varlen=True)
            return out, (final if self.mode == "LSTM" else final[0])
        out, final = ENGINES[self.mode, backend](values, states, self._layer_parameters(), lengths, self.options,
                                                 dropout=self.dropout, training=self.training, **rows)
        return out, (final if self.mode == "LSTM" else final[0])

    def cell(self, layer: int = 0, direction: int = 0) -> "CellView":
        """A step-wise cell sharing layer ``layer``'s weights in ``direction`` (0 forward, 1 reverse):
        ``cell(x_t (B, F_l) or (F_l,), state) -> state``, F_l = input_size for layer 0, D * H_out
        above (the layer below's output); the :class:`CellView` docstring. ValueError for a layer
        outside [0, num_layers) or a direction outside [0, D)."""
        dirs = 2 if self.bidirectional else 1
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected 0 <= layer < num_layers = {self.num_layers}, got {layer}")
        if not 0 <= direction < dirs:
            raise ValueError(f"direction: expected 0 <= direction < {dirs}, got {direction}")
        return CellView(self, layer, direction)

    def extra_repr(self) -> str:
        extra = super().extra_repr()  # type: ignore[misc]
        if not self.options.plain:
            opts = self.options.changed()
            if self.mode == "GRU":
                opts.pop("zoneout", None)
                if self.options.zoneout[0]:
                    opts["zoneout"] = self.options.zoneout[0]
            extra += ", " + ", ".join(f"{k}={v!r}" for k, v in opts.items())
        if self.checkpoint_every is not None:
            extra += f", checkpoint_every={self.checkpoint_every!r}"
        return extra


class LSTM(_CellOptionsMixin, _LengthsMixin, nn.LSTM):
    __doc__ = (
        "Long short-term memory (Hochreiter & Schmidhuber 1997) as :class:`torch.nn.LSTM`, plus "
        "per-sequence lengths and cell options.\n"
        + COMMON_DOC.format(
            name="LSTM",
            hx_doc=" ``(h_0, c_0)``, (L*D, B, H_out) and (L*D, B, H) (unbatched: no B dimension)",
            ret_doc="(h_n, c_n)",
            final_doc="h_n (L*D, B, H_out) and c_n (L*D, B, H), dtype of input.",
        )
        + OPTIONS_DOC
    )

    def __init__(self, *args: Any, layer_norm: bool = False, peephole: bool = False, cell_clip: float | None = None,
                 zoneout: float | tuple[float, float] | None = None, recurrent_dropout: float = 0.0,
                 proj_clip: float | None = None, checkpoint_every: int | str | None = None, **kwargs: Any) -> None:
        options = CellOptions.make(layer_norm, peephole, cell_clip, zoneout, recurrent_dropout, proj_clip)
        super().__init__(*args, **kwargs)
        self._set_checkpoint_every(checkpoint_every)
        if options.proj_clip is not None and self.proj_size == 0:
            raise ValueError(f"proj_clip: clips the projection, so it needs proj_size > 0; got proj_clip="
                             f"{options.proj_clip} with proj_size=0")
        self._init_options(options)


class CellView(NotScriptable, nn.Module):
    """One layer/direction of a :class:`LSTM` or :class:`GRU` as a step-wise cell (shares the parameters).

    LSTM: ``forward(input (B, F_l) or (F_l,), hx=None) -> (h (B, H_out), c (B, H))``; GRU:
    ``forward(input, hx=None) -> h (B, H)`` (unbatched: no B). Eval semantics for zoneout (the
    expectation) and no recurrent dropout. Runs :func:`._cells.cell_step`, as :class:`fastlayers.LSTMCell`
    / ``GRUCell`` do (bitwise-equal steps for the same parameters); errors, autocast handling and
    result dtypes as theirs.
    """

    def __init__(self, rnn: "LSTM | GRU", layer: int, direction: int) -> None:
        super().__init__()
        self._rnn = [rnn]  # not a submodule: the parameters belong to the layer
        self.layer, self.direction = layer, direction

    def forward(self, input: Tensor, hx: Any = None) -> Any:
        if twice.grad_mode_in_inference_mode():  # (as the cells')
            with torch.no_grad():
                return CellView.forward(self, input, hx)
        rnn = self._rnn[0]
        params = rnn._layer_parameters()[self.layer][self.direction]
        sizes = (rnn.proj_size or rnn.hidden_size, rnn.hidden_size) if rnn.mode == "LSTM" else (rnn.hidden_size,)
        # the checked step of fastlayers.LSTMCell / GRUCell: bitwise-equal steps for equal parameters
        return cell_step(f"{rnn.mode}Cell", rnn.mode, input, hx, params, rnn.options,
                         input_size=params["weight_ih"].size(1), sizes=sizes, bias=rnn.bias)


class GRU(_CellOptionsMixin, _LengthsMixin, nn.GRU):
    __doc__ = (
        "Gated recurrent unit (Cho et al. 2014, cuDNN/torch form) as :class:`torch.nn.GRU`, plus "
        "per-sequence lengths.\n"
        + COMMON_DOC.format(
            name="GRU", hx_doc=" ``h_0`` (L*D, B, H)", ret_doc="h_n", final_doc="h_n (L*D, B, H), dtype of input."
        )
        + GRU_OPTIONS_DOC
    )

    def __init__(self, *args: Any, layer_norm: bool = False, zoneout: float | None = None,
                 recurrent_dropout: float = 0.0, checkpoint_every: int | str | None = None, **kwargs: Any) -> None:
        options = CellOptions.make_gru(layer_norm, zoneout, recurrent_dropout)
        super().__init__(*args, **kwargs)
        self._set_checkpoint_every(checkpoint_every)
        self._init_options(options)


class RNN(_LengthsMixin, nn.RNN):
    __doc__ = (
        "Elman RNN (Elman 1990) with tanh or ReLU nonlinearity as :class:`torch.nn.RNN`, plus per-sequence lengths.\n"
        + COMMON_DOC.format(
            name="RNN", hx_doc=" ``h_0`` (L*D, B, H)", ret_doc="h_n", final_doc="h_n (L*D, B, H), dtype of input."
        )
    )

    def forward(self, input: Any, hx: Any = None, *, lengths: Any = None, cu_seqlens: Any = None,
                max_seqlen: Any = None) -> Any:
        """As :meth:`LSTM.forward`: ``input`` (T, B, F) (or (B, T, F), (T, F), PackedSequence, the
        varlen (N, F) with ``cu_seqlens``, a jagged NestedTensor), ``hx`` (L*D, B, H) or None,
        ``lengths`` (B,) or None -> ``(output (T, B, D*H), h_n (L*D, B, H))`` with the packed
        semantics; errors as torch.nn.RNN's (the class docstring)."""
        input, hx = self._autocast_operands(input, hx)  # (before the low-precision test below; idempotent)
        if cu_seqlens is not None or max_seqlen is not None or (isinstance(input, Tensor) and input.is_nested):
            return super().forward(input, hx, lengths=lengths, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        weight = self._flat_weights[0].dtype
        if isinstance(input, Tensor) and input.device.type == "cpu" and _precision.is_low(input) \
                and (input.dtype == weight or weight == torch.float32 and torch.is_autocast_enabled("cpu")):
            return self._forward_in_float32(input, hx, lengths)  # (another dtype: torch's error, below)
        return super().forward(input, hx, lengths=lengths)

    def _forward_in_float32(self, input: Tensor, hx: Any, lengths: Any) -> Any:
        """A low-precision call on CPU (see :mod:`fastlayers._core.precision`): torch's float32 kernels
        on the operands rounded to the low dtype, so hidden states and gradient sums stay float32
        (the segment path's per-segment gradients would otherwise be summed in bf16); outputs in
        the low dtype."""
        low = _precision.dtypes(input)[0]
        self._update_flat_weights()  # (the parameters this call sees: see _LengthsMixin._run)
        if hx is not None and input.dtype == self._flat_weights[0].dtype:  # (low-precision parameters)
            self._check_args(input, hx)  # torch's errors for a state of another dtype, before it is rounded
        rounded = lambda t: _precision.rounded(t, low)  # noqa: E731
        # torch's RNN kernels read _flat_weights: a view of this module for this call holds the rounded
        # ones (the module itself is never written: calls from other threads see their own weights)
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__, _flat_weights=[rounded(w) for w in self._flat_weights],
                             _update_flat_weights=lambda: None)  # (a parametrized weight reads as changed)
        with torch.autocast("cpu", enabled=False):
            out, h = _LengthsMixin.forward(view, rounded(input), rounded(hx), lengths=lengths)
        return out.to(low), h.to(low)

    def extra_repr(self) -> str:  # torch's repr leaves the nonlinearity out; a ReLU RNN should say so
        extra = super().extra_repr()
        return extra + (f", nonlinearity={self.nonlinearity!r}" if self.nonlinearity != "tanh" else "")


__all__ = ["LSTM", "GRU", "RNN"]
