"""Drop-in torch.nn.LSTM / GRU / RNN with a per-sequence ``lengths`` argument.

The classes subclass the torch modules, so constructor arguments, parameter names
(``weight_ih_l{k}{_reverse}``, ...), ``state_dict`` and the forward contract without lengths
(padded Tensor, unbatched 2-D, PackedSequence, ``hx``) are torch's own, running torch's kernels.
``forward(input, hx=None, *, lengths=None)`` adds the lengths path (:mod:`._varlen`), and
``LSTM(..., layer_norm=, peephole=, cell_clip=, zoneout=, recurrent_dropout=)`` adds cell options,
run by the engine (:mod:`._engine` on CPU, :mod:`._engine_gpu` on CUDA; :mod:`._engine_reference`
where neither runs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from .._checks import as_lengths
from .._jit import ENGINE, NotScriptable, refuse_trace
from .. import _ops_lib, _precision
from .._backend import select
from ._cells import step
from ._export import operator_layers
from . import _graphs
from ._options import CellOptions
from ._reference import reference_varlen_rnn
from ._remat import check_every, checkpointed
from ._routing import ENGINES
from ._validate import check_cell, check_layer
from ._varlen import varlen_rnn

class _LengthsMixin(NotScriptable):
    """Validation and lengths dispatch shared by LSTM, GRU and RNN (mixed into torch's classes)."""

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

    def _check_args(self, input: object, hx: object) -> tuple[Tensor, tuple[Tensor, ...] | None]:
        """(input, hx as batched 3-D states or None), or torch.nn's error for the same call (see
        :mod:`._validate`)."""
        batch = 1
        if isinstance(input, Tensor) and input.dim() == 3:
            batch = input.size(0 if self.batch_first else 1)
        layers = self.num_layers * (2 if self.bidirectional else 1)
        expected = tuple((layers, batch, size) for size in self._state_sizes())
        return check_layer("RNN" if self.mode.startswith("RNN") else self.mode, input, hx, input_size=self.input_size,
                           weight_dtype=self._flat_weights[0].dtype, expected=expected)

    def _options_plain(self) -> bool:
        return True

    def _engine_backend(self, input: Tensor) -> str | None:
        """The backend ("cpu", "triton", "reference") of the fastlayers engine when it runs this call
        with or without lengths, else None: torch's kernel without lengths, and with lengths
        :meth:`_run` decides. LSTM and GRU only, see :class:`_CellOptionsMixin`."""
        return None

    def forward(self, input: Any, hx: Any = None, *, lengths: Any = None) -> Any:  # noqa: D102
        if isinstance(input, PackedSequence):
            if lengths is not None:
                raise ValueError("lengths: expected None for PackedSequence input (it carries its own lengths)")
            if not self._options_plain():
                return self._forward_packed(input, hx)
            return super().forward(input, hx)  # type: ignore[misc]
        exporting = torch.compiler.is_exporting()  # every layer one operator (._export): T and B stay dynamic
        # an input that _check_args passes as it is: the backend is decided first (once), and the plain
        # call goes straight to torch's forward
        common = (lengths is None and hx is None and not exporting and type(input) is Tensor and input.dim() == 3
                  and input.size(2) == self.input_size and input.dtype == self._flat_weights[0].dtype)
        engine = self._engine_backend(input) if common else None
        if common and engine is None:
            return super().forward(input)  # type: ignore[misc]
        if lengths is not None and torch.compiler.is_compiling() and not exporting:
            from .._compiling import eagerly  # one graph break: the plan reads the lengths on the host

            return eagerly(self.forward, input, hx, lengths=lengths)
        input, states = self._check_args(input, hx)
        time_dim = 1 if self.batch_first and input.dim() == 3 else 0
        if input.size(time_dim) == 0:  # torch.nn's RNNs raise this (their kernel's message)
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
            layers = self.num_layers * (2 if self.bidirectional else 1)
            states = tuple(x.new_zeros(layers, batch, size) for size in self._state_sizes())
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
            layers = self.num_layers * (2 if self.bidirectional else 1)
            states = tuple(x.new_zeros(layers, 0, size) for size in self._state_sizes())
        impl = ENGINES[self.mode, "reference"]
        xt = x.transpose(0, 1) if self.batch_first else x
        out, final = impl(xt, states, self._layer_parameters(), None, self.options, dropout=self.dropout,
                          training=self.training)
        out = out.transpose(0, 1) if self.batch_first else out
        return out, (final if self.mode == "LSTM" else final[0])

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


_COMMON_DOC = """
    Shape legend: T time steps, B batch, F = input_size, H = hidden_size (H_out = proj_size if
    proj_size > 0 else hidden_size), L = num_layers, D = 2 if bidirectional else 1.

    Forward: ``forward(input, hx=None, *, lengths=None)``.

    * ``input``: (T, B, F) float tensor, (B, T, F) if ``batch_first``, unbatched (T, F), or a
      PackedSequence (then the output is a PackedSequence, exactly as torch).
    * ``hx``: initial state{hx_doc}; zeros if omitted.
    * ``lengths``: optional per-sequence lengths, a 1-D integer tensor on any device or a sequence
      of B Python ints, ``1 <= lengths[b] <= T``, any order, duplicates allowed (for unbatched
      input: one length). Semantics are exactly those of torch's PackedSequence path: output
      rows at ``t >= lengths[b]`` are zero; the final state of the forward direction is taken
      after each sequence's own last step, that of the reverse direction after t = 0, and the
      reverse direction starts at each sequence's own last step.

    Returns ``(output, {ret_doc})``: output (T, B, D*H_out) (or (B, T, D*H_out), or (T, D*H_out)),
    {final_doc}

    With lengths on CPU (float32/float64), LSTM and GRU run the fastlayers engine on the packed
    valid rows (no GEMM or kernel touches padding; hand-written backward); RNN runs torch's fused
    kernels once per run of time steps with the same set of active sequences. A batch without
    padding takes torch's padded kernel. On CUDA (float32, bfloat16, float16), LSTM and GRU
    with or without lengths run the fastlayers GPU engine (Triton step kernels, time loops as
    captured CUDA graphs replayed for any T) where it measured faster than cuDNN on an H100
    (BENCHMARKS.md): hidden_size >= 256 and B * hidden_size <= 2**17 (the seed's BLSTM: 0.24x
    cuDNN's fwd+bwd time), and only for a call whose loops replay graphs captured already (the
    first call of a batch size, dtype or grad mode, or one with a longer T than any before, runs
    on cuDNN while they are captured for the next); else, with ``FASTLAYERS_CUDA_GRAPHS=0``,
    inside a CUDA graph capture of the caller's, under torch.compile, or in float64 they use
    torch's kernels (cuDNN; its packed path with lengths), as RNN always does elsewhere.

    Errors: for every input torch.nn.{name} rejects, the exception is an instance of torch's class
    (and of ours) and its message starts with torch's message for that input, then ``"; "`` and our
    details naming the argument, expected vs got (:mod:`fastlayers.rnn._validate`); checks run in
    torch's order. TypeError and AttributeError for a non-tensor ``input`` or ``hx``; TypeError,
    IndexError, RuntimeError and AttributeError for an LSTM ``hx`` that is not a pair (h_0, c_0);
    TypeError and ValueError for an ``input`` dtype other than the parameters' (or integer), with
    torch's hint; TypeError and RuntimeError for ``hx`` of another dtype than the input (message of
    torch's device-independent check, ``Input and hidden tensors are not the same dtype``);
    ValueError and RuntimeError for a feature size other than input_size or ``hx`` of the wrong
    shape or rank; ValueError for a wrong input rank. Ours only: TypeError for float ``lengths``,
    ValueError for lengths of the wrong size or outside [1, T], or ``lengths`` with PackedSequence
    input.

    Non-finite input: no kernel assumes finite values. A NaN in ``input`` at (t, b) makes NaN
    exactly the outputs and final states that depend on it, as the float64 reference does:
    sequence b from step t on (forward direction), up to step t (reverse direction), and what
    later layers compute from those; other sequences stay finite. +-inf saturates the gates
    (the sigmoid / tanh limits, as torch) and becomes NaN where a LayerNorm subtracts it from
    itself. Values at padded steps (t >= lengths[b]) are never read. Inputs of size 1e4 keep
    every output, state and gradient finite (gates saturate; LayerNorm normalises).

    Initialisation (``reset_parameters()``, called once by the constructor): torch's rule,
    uniform(-1/sqrt(H), 1/sqrt(H)), for every weight and bias; with options see below.
    Construction on ``device="meta"`` then ``to_empty(device=...)`` and ``reset_parameters()``
    gives the parameters a normal construction gives after the same ``torch.manual_seed``.

    Mirrors :class:`torch.nn.{name}` (same constructor arguments, parameter names and shapes;
    ``load_state_dict(strict=True)`` works in both directions).
"""


_OPTIONS_DOC = """
    Cell options (keyword-only; all off = torch.nn.LSTM math on torch's kernels; any on = the
    fastlayers engine, see :mod:`fastlayers.rnn._engine`), per layer and direction, gates i, f, g, o:

    * ``layer_norm=True`` (Ba et al. 2016, as haste's LayerNormLSTM):
      ``pre = LN(W_ih x_t; gamma_ih) + LN(W_hh h_{t-1}; gamma_hh) + b_ih + b_hh``,
      ``h_t = o_t * tanh(LN(c_t; gamma_c, beta_c))`` with ``LN(v; g, b) = g * (v - mean(v)) /
      sqrt(var(v) + 1e-5) + b`` over the 4H pre-activations (H for the cell). Parameters
      ``ln_ih_weight_l{k}`` (4H), ``ln_hh_weight_l{k}`` (4H), ``ln_cell_weight_l{k}`` (H),
      ``ln_cell_bias_l{k}`` (H) (``_reverse`` suffix for the reverse direction), initialised 1 / 0.
    * ``peephole=True`` (Gers & Schmidhuber 2000, diagonal, as oneDNN):
      ``i = sig(pre_i + w_ci * c_{t-1})``, ``f = sig(pre_f + w_cf * c_{t-1})``,
      ``o = sig(pre_o + w_co * c_t)``; parameter ``weight_peephole_l{k}`` (3H: w_ci, w_cf, w_co),
      initialised uniform(-1/sqrt(H), 1/sqrt(H)) like the other weights.
    * ``cell_clip=c``: ``c_t = clamp(f*c_{t-1} + i*g, -c, c)`` (cuDNN's cell clip).
    * ``zoneout=(z_h, z_c)`` or one probability (Krueger et al. 2016): in training each unit of
      h and c keeps its previous value with probability z (fresh masks every step); in eval the
      expectation ``z*prev + (1-z)*new``.
    * ``recurrent_dropout=p`` (Gal & Ghahramani 2016): in training one Bernoulli(1-p)/(1-p) mask
      per sequence and layer/direction multiplies h_{t-1} before W_hh, the same at every step.
    * ``proj_clip=p`` (with ``proj_size > 0``; TF's LSTMCell proj_clip):
      ``h_t = clamp(W_hr (o_t * tanh(.)), -p, p)``. With a projection, zoneout and recurrent
      dropout act on the projected h_t (what recurs), the cell options on the H-sized cell.

    * ``checkpoint_every=k`` (an int >= 1, or ``"auto"`` for about sqrt(T / D); default None):
      recomputation through time for long sequences (:mod:`._remat`). In a call that records
      gradients, each layer and direction runs as segments of k steps; the forward keeps only the
      state entering each segment (and the masks it drew), the backward runs each segment again
      from it. Memory about (T/k + k) states per layer instead of every step's activations, for
      one more forward; the same gradients up to the order of sums. Not a parameter nor in
      ``state_dict``; with it on, a call without options runs the engine too.

    PackedSequence input: run as its padded batch with ``lengths=`` (the same call, the same numbers),
    the output packed again as torch returns it (the input's batch_sizes and indices). Bad option values raise
    ValueError/TypeError naming the option. ``cell(layer, direction)`` returns a step-wise cell
    sharing the weights (eval semantics) for decoding one step at a time.

    Devices: on CPU the engine's C kernels; on CUDA the GPU engine (:mod:`._engine_gpu`, Triton
    step kernels and step GEMMs, cuBLAS for the rest) whose time loops run as a chunk of steps
    captured in a CUDA graph once per batch size and dtype and replayed for any T (a longer T
    than any before captures again, with larger buffers; :mod:`._graphs`;
    ``FASTLAYERS_CUDA_GRAPHS=0`` keeps them eager).
"""


_GRU_OPTIONS_DOC = """
    Cell options (keyword-only; all off = torch.nn.GRU math on torch's kernels; any on = the
    fastlayers engine), per layer and direction, gates r, z, n as torch.nn.GRU:

    * ``layer_norm=True`` (Ba et al. 2016, as haste's LayerNormGRU):
      ``gi = LN(W_ih x_t; gamma_ih) + b_ih``, ``gh = LN(W_hh h_{t-1}; gamma_hh) + b_hh``,
      ``r = sig(gi_r + gh_r)``, ``z = sig(gi_z + gh_z)``, ``n = tanh(gi_n + r * gh_n)``,
      ``h_t = (1 - z) * n + z * h_{t-1}``, LN over the 3H pre-activations without bias (eps 1e-5).
      Parameters ``ln_ih_weight_l{k}``, ``ln_hh_weight_l{k}`` (3H) (``_reverse`` suffix for the
      reverse direction), initialised to 1.
    * ``zoneout=z`` (Krueger et al. 2016): in training each unit of h keeps its previous value
      with probability z (fresh masks every step); in eval the expectation ``z*prev + (1-z)*new``.
    * ``recurrent_dropout=p`` (Gal & Ghahramani 2016): in training one Bernoulli(1-p)/(1-p) mask
      per sequence and layer/direction multiplies h_{t-1} before W_hh (the z * h_{t-1} term uses
      the unmasked state), the same at every step.
    * ``checkpoint_every=k`` or ``"auto"``: recomputation through time, as :class:`LSTM`'s.

    PackedSequence input: as its padded batch with ``lengths=``, the output packed again as torch
    returns it. Bad option values raise ValueError/TypeError
    naming the option. ``cell(layer, direction)`` returns a step-wise cell sharing the weights.
"""


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
        with torch.no_grad():
            for name in self._option_parameter_names():
                if name.startswith("ln_"):
                    getattr(self, name).fill_(0.0 if name.startswith("ln_cell_bias") else 1.0)

    def _options_plain(self) -> bool:
        return self.options.plain and self.checkpoint_every is None

    def _set_checkpoint_every(self, every: Any) -> None:
        self.checkpoint_every = check_every("checkpoint_every", every)

    def _recomputes(self) -> bool:
        """Whether this call runs as recomputed segments: checkpoint_every set, gradients recorded,
        not traced by torch.compile."""
        return self.checkpoint_every is not None and torch.is_grad_enabled() and not torch.compiler.is_compiling()

    def _engine_precision(self, input: Tensor) -> bool:
        # torch's CPU LSTM kernel under bf16 autocast needs oneDNN's bf16 LSTM (AVX512-BF16 CPUs; it
        # fails elsewhere) and with bf16 parameters keeps the cell state in bf16: the engine (or its
        # per-step reference) keeps it in float32 on every CPU
        return input.device.type == "cpu" and _precision.is_low(input)

    def _plain_on_engine(self, input: Tensor) -> bool:
        # Measured on an H100 (torch 2.11, fp32 TF32 off, 2 directions, fwd+bwd; BENCHMARKS.md,
        # bench_gpu_engine.py --sweep, 2026-11-24): with its time loops in CUDA graphs the engine took
        # 0.24x (LSTM) / 0.22x (GRU) cuDNN's time at the seed shape (T=800, B=32, H=256), 0.72-0.99x
        # at H=256-1024 with B*H <= 2^17, but 1.22-1.82x at H <= 128 (cuDNN's steps are short there)
        # and 1.18-1.25x at B=256, H=1024 (the step's GEMM dominates); eagerly it took 3.4-3.8x. So:
        # H >= 256 and B*H <= 2^17 with graphs on (not switched off, not inside the caller's own
        # capture, not under torch.compile), and only where this call's loops replay graphs captured
        # already (_engine_gpu.replays: a call that would capture runs on cuDNN while they are
        # captured for the next one); float64 (not measured) stays on cuDNN too. Asked only once the
        # backend is Triton (_engine_backend)
        from ._engine_gpu import replays

        batch = input.size(0 if self.batch_first else 1) if input.dim() == 3 else 1
        return (input.device.type == "cuda" and input.dtype != torch.float64 and self.hidden_size >= 256
                and batch * self.hidden_size <= 2**17 and not torch.compiler.is_compiling()
                and _graphs.enabled(input) and replays(self, input))

    def _engine_backend(self, input: Tensor) -> str | None:
        if not self.options.plain or self._engine_precision(input) or self._recomputes():
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
        return [[{k: getattr(self, f"{k}_l{layer}{sfx}") for k in keys}
                 for sfx in ("", "_reverse")[: 2 if self.bidirectional else 1]] for layer in range(self.num_layers)]

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
        if engine == "cpu" and _ops_lib.serves(x):  # no autograd: one C++ operator per layer (._export)
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

    def cell(self, layer: int = 0, direction: int = 0) -> "CellView":
        """A step-wise cell sharing this layer's weights: ``cell(x_t (B, F), state) -> state``."""
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
        + _COMMON_DOC.format(
            name="LSTM",
            hx_doc=" ``(h_0, c_0)``, (L*D, B, H_out) and (L*D, B, H) (unbatched: no B dimension)",
            ret_doc="(h_n, c_n)",
            final_doc="h_n (L*D, B, H_out) and c_n (L*D, B, H), dtype of input.",
        )
        + _OPTIONS_DOC
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
    expectation) and no recurrent dropout. Runs :func:`._cells.step`, as :class:`fastlayers.LSTMCell`
    / ``GRUCell`` do (bitwise-equal steps for the same parameters); errors as theirs.
    """

    def __init__(self, rnn: "LSTM | GRU", layer: int, direction: int) -> None:
        super().__init__()
        self._rnn = [rnn]  # not a submodule: the parameters belong to the layer
        self.layer, self.direction = layer, direction

    def forward(self, input: Tensor, hx: Any = None) -> Any:
        rnn = self._rnn[0]
        params = rnn._layer_parameters()[self.layer][self.direction]
        w = params["weight_ih"]
        sizes = (rnn.proj_size or rnn.hidden_size, rnn.hidden_size) if rnn.mode == "LSTM" else (rnn.hidden_size,)
        x, states, batched = check_cell(f"{rnn.mode}Cell", rnn.mode, input, hx, input_size=w.size(1),
                                        weight_dtype=w.dtype, sizes=sizes)
        # the step function of fastlayers.LSTMCell / GRUCell: bitwise-equal steps for equal parameters
        new = step(rnn.mode, x, states, params, rnn.options)
        new = new if batched else tuple(s.squeeze(0) for s in new)
        return new if rnn.mode == "LSTM" else new[0]


class GRU(_CellOptionsMixin, _LengthsMixin, nn.GRU):
    __doc__ = (
        "Gated recurrent unit (Cho et al. 2014, cuDNN/torch form) as :class:`torch.nn.GRU`, plus "
        "per-sequence lengths.\n"
        + _COMMON_DOC.format(
            name="GRU", hx_doc=" ``h_0`` (L*D, B, H)", ret_doc="h_n", final_doc="h_n (L*D, B, H), dtype of input."
        )
        + _GRU_OPTIONS_DOC
    )

    def __init__(self, *args: Any, layer_norm: bool = False, zoneout: float | None = None,
                 recurrent_dropout: float = 0.0, checkpoint_every: int | str | None = None, **kwargs: Any) -> None:
        options = CellOptions.make_gru(layer_norm, zoneout, recurrent_dropout)
        super().__init__(*args, **kwargs)
        self._set_checkpoint_every(checkpoint_every)
        self._init_options(options)


class RNN(_LengthsMixin, nn.RNN):
    __doc__ = (
        "Elman RNN with tanh or ReLU nonlinearity as :class:`torch.nn.RNN`, plus per-sequence lengths.\n"
        + _COMMON_DOC.format(
            name="RNN", hx_doc=" ``h_0`` (L*D, B, H)", ret_doc="h_n", final_doc="h_n (L*D, B, H), dtype of input."
        )
    )

    def forward(self, input: Any, hx: Any = None, *, lengths: Any = None) -> Any:  # noqa: D102
        if isinstance(input, Tensor) and input.device.type == "cpu" and _precision.is_low(input):
            return self._forward_in_float32(input, hx, lengths)
        return super().forward(input, hx, lengths=lengths)

    def _forward_in_float32(self, input: Tensor, hx: Any, lengths: Any) -> Any:
        """A low-precision call on CPU (see :mod:`fastlayers._precision`): torch's float32 kernels
        on the operands rounded to the low dtype, so hidden states and gradient sums stay float32
        (the segment path's per-segment gradients would otherwise be summed in bf16); outputs in
        the low dtype."""
        low = _precision.dtypes(input)[0]
        rounded = lambda t: t.to(low).float() if isinstance(t, Tensor) else t  # noqa: E731
        own = self._flat_weights  # what torch's RNN kernels read: swapped for this call only
        self._flat_weights = [rounded(w) for w in own]
        try:
            with torch.autocast("cpu", enabled=False):
                out, h = super().forward(rounded(input), rounded(hx), lengths=lengths)
        finally:
            self._flat_weights = own
        return out.to(low), h.to(low)

    def extra_repr(self) -> str:  # torch's repr leaves the nonlinearity out; a ReLU RNN should say so
        extra = super().extra_repr()
        return extra + (f", nonlinearity={self.nonlinearity!r}" if self.nonlinearity != "tanh" else "")


__all__ = ["LSTM", "GRU", "RNN"]
