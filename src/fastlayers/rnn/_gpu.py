"""The recurrent engine on the GPU: LSTM / GRU with cell options, Triton step kernels, cuBLAS GEMMs.

Legend: T time, B batch, F input features, H hidden size, G gates (4H LSTM, 3H GRU), P output
size (proj_size, or H), D directions, L layers.

Same math and signatures as the CPU engine (:mod:`._cpu`), another layout: the CPU engine packs
the valid rows, this one keeps the padded batch and takes the lengths as data. Per layer, all
directions at once:

* the input projection of every (t, b) for every direction is one GEMM, x (T*B, F) @ W_ih^T
  (F, D*G), before the time loop; its gradients dX and dW_ih are one GEMM each after the backward
  loop (the gradient rows of padding positions are zero);
* per step s: one recurrent product (D, B, P) @ (D, P, G) (a Triton GEMM,
  :mod:`fastlayers._triton.step_matmul`) and one Triton kernel
  (:mod:`fastlayers._triton.lstm` / ``gru``) that runs, for each (direction, sequence), time
  t = s (forward) or T - 1 - s (reverse) where t < len_b, and otherwise leaves the state as it is
  and writes zeros at time t (the reverse direction waits out the padding first, so no address
  depends on the lengths); with a projection, one more GEMM and kernel;
* the backward runs the step kernels and the recurrent product in reverse (that product in S
  partial sums over slices of G, which the next step kernel adds); dW_hh (dW_hr) is one GEMM
  after the loop; the LayerNorm and peephole parameter gradients are the sums over the rows of
  per-row sums (D, B, X) that each step kernel adds its row's terms to (one program per row, the
  steps one launch after another: deterministic, no atomics, and no buffer of T x B rows).

Grid of the step kernels (decided from the static facts of ``benchmarks/gpu_static.py``, Triton 3.6,
sm_90a; to be measured on the GPU): one 4-warp program per (direction, sequence), i.e. 64 programs
at the seed shape (D=2, B=32) on the H100's 132 SMs. Kept because (1) the LayerNorms need the
statistics of a whole row (4H pre-activations, H cell values): splitting a row over programs would
need a cross-program reduction per step (a second launch or atomics plus a grid barrier); (2) the
kernels are small next to the step's recurrent GEMM: 40-64 registers at H=256 without spills, six
reductions (one per LayerNorm statistic) and 11-17 barriers per step kernel, every step compiled
once (the step index is not specialised); (3) B*D programs fill the GPU from B=64 on (D=2).
Measured on the H100 (2026-11-24, eager LN-LSTM fwd+bwd under the profiler): step kernels 3.1 ms
(forward) + 3.7 ms (backward) of 18.6 ms device time, the recurrent products 7.2 ms. Not measured
yet: H=1024 (105-146 registers, no spills) and small B, where 8 warps per program, or rows split
over 2-4 programs for the kernels without LayerNorm, are the candidates.

The varlen form (input (N, F), the sequences one after another, issue 66) runs the same loops on
the value rows themselves: the input projection, the output and every buffer the loops save are
(N, ...) instead of (T, B, ...), sequence b's time t at row starts[b] + t; per step each
(direction, sequence) program runs its own row where t < len_b and does nothing else (no padding
position to write), and the recurrent product gathers the step's rows
(:mod:`fastlayers._triton._cell`, :mod:`fastlayers._triton.step_matmul`).

Nothing in the time loop depends on the lengths' values or on T on the host: the step s is
device data of every launch (:mod:`fastlayers._triton._cell`), so a chunk of steps is captured
once in a CUDA graph and replayed for any lengths and any T (:mod:`._gpu_graphs`; the plain modules'
dispatch asks :func:`replays`). With lengths the loops run up to the longest sequence only (the
output's rows after it are zeros). The GEMMs outside the loop are torch's (cuBLAS); all follow
torch's precision flags: float32 GEMMs use TF32 only where
``torch.backends.cuda.matmul.allow_tf32`` allows it. Precision (:mod:`fastlayers._core.precision`):
float32 and float64 run in their dtype; bfloat16 / float16, and float32 under
``torch.autocast("cuda")``, take low-precision GEMM operands with float32 accumulation, and keep
the cell state, gates and LayerNorm statistics in float32.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import Tensor

from .._core import jagged, precision as _precision, twice
from . import _gpu_graphs
from ._common import drawn_masks, input_bias, stack_directions
from ._options import CellOptions
from ._gpu_layers import GRULayer, LSTMLayer, Varlen, _tf32



def lstm_engine_gpu(input: Tensor, hx: tuple[Tensor, Tensor], layers: list[list[dict[str, Tensor]]],
                    lengths: Tensor | None, options: CellOptions, *, dropout: float = 0.0, training: bool = False,
                    masks: list[dict[str, Tensor]] | None = None, varlen: jagged.Varlen | None = None
                    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """As :func:`fastlayers.rnn._cpu.lstm_engine` (same arguments, results and masks), on the
    Triton backend (CUDA tensors; CPU tensors under Triton's interpreter). Also takes, for one
    layer, an input per direction: (D, T, B, F), direction d reading its own as it would the
    layer's (the reverse one from each sequence's last valid row back); its gradient is then
    (D, T, B, F), and such a call does not differentiate twice (RuntimeError). With ``varlen``
    (:func:`fastlayers._core.jagged.varlen`, time-major; ``lengths`` its lengths): the varlen form,
    input (N, F) and output (N, D*P), every buffer sized by N; given zoneout masks (D, N, width) on
    the value rows; drawn ones are the padded call's (the same draws from the same seed)."""
    return _engine("LSTM", input, hx, layers, lengths, options, dropout, training, masks, varlen)


def gru_engine_gpu(input: Tensor, hx: tuple[Tensor], layers: list[list[dict[str, Tensor]]], lengths: Tensor | None,
                   options: CellOptions, *, dropout: float = 0.0, training: bool = False,
                   masks: list[dict[str, Tensor]] | None = None, varlen: jagged.Varlen | None = None
                   ) -> tuple[Tensor, tuple[Tensor]]:
    """As :func:`fastlayers.rnn._cpu.gru_engine`, on the Triton backend (``varlen`` as
    :func:`lstm_engine_gpu`'s)."""
    return _engine("GRU", input, hx, layers, lengths, options, dropout, training, masks, varlen)


# plain-call signature -> (_gpu_graphs.generation, longest T) for which every loop of such a call replays
_READY: "OrderedDict[tuple, tuple[int, int]]" = OrderedDict()
_READY_KEYS = 256
_UNREADY: set[tuple] = set()  # signatures whose capture failed: cuDNN from then on


def replays(module, input: Tensor) -> bool:
    """Whether every time loop of this call of the plain ``module`` (a fastlayers LSTM / GRU without
    cell options) replays captured graphs (:mod:`._gpu_graphs`), so that the engine can serve it
    without a capture. When not (the first call of a batch size, dtype, device or grad mode, a T
    longer than the captured buffers hold, or entries dropped since), the loops are captured now
    for the next such call, by a capture-only run of the engine on one step (its results unused;
    a failure warns), and False is returned: this call is cuDNN's. A call of at most
    ``_gpu_graphs.EAGER_STEPS`` steps is cuDNN's too (the engine would run its loops eagerly).

    input: (T, B, F), or (B, T, F) if ``module.batch_first``, or unbatched (T, F); on a device
    where :func:`._gpu_graphs.enabled`. Raises nothing (a failed capture warns)."""
    x = input if input.dim() == 3 else input.unsqueeze(0 if module.batch_first else 1)
    if module.batch_first:
        x = x.transpose(0, 1)
    steps, batch, features = x.shape
    if steps <= _gpu_graphs.EAGER_STEPS:  # the engine's loops would run eagerly: torch's kernels serve it
        return False
    module._update_flat_weights()  # (the parameters this call sees, as torch's forward: functional_call)
    grad = twice.graph_recorded() and (input.requires_grad or any(w.requires_grad for w in module._flat_weights))
    sig = (module.mode, batch, features, module.hidden_size, getattr(module, "proj_size", 0), module.num_layers,
           module.bidirectional, module.bias, _precision.dtypes(input), input.device, grad, _tf32())
    ready = _READY.get(sig)
    if ready is not None and ready[0] == _gpu_graphs.generation and steps <= ready[1]:
        _READY.move_to_end(sig)
        return True
    if sig not in _UNREADY and not _saving_through_hooks():
        _prepare(module, x, steps, grad, sig)
    return False


def _saving_through_hooks() -> bool:
    """Whether tensors that autograd saves now go through saved-tensor hooks (a non-reentrant
    ``torch.utils.checkpoint``, ``torch.autograd.graph.saved_tensors_hooks`` / ``save_on_cpu``):
    no capture-only preparation then (its forward and backward would run inside the hooks, and a
    checkpoint's recomputation counts the tensors its forward saved); the call is cuDNN's."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)  # (torch >= 2.4)
    return top is not None and top(True) is not None


def _prepare(module, x: Tensor, steps: int, grad: bool, sig: tuple) -> None:
    """Capture the loops of a plain call of up to ``steps`` steps like x (T, B, F): the engine on
    one step of zeros with :func:`._gpu_graphs.preparing`, through its backward when ``grad``."""
    batch, features = x.shape[1:]
    dirs = 2 if module.bidirectional else 1
    engine = lstm_engine_gpu if module.mode == "LSTM" else gru_engine_gpu
    failed = _gpu_graphs.stats["failed"]
    _gpu_graphs.limit_bytes(x.device)  # (a bad FASTLAYERS_CUDA_GRAPHS_MAX_MB: its ValueError, as a layer with options
    try:                                # gives it, not a capture failure that keeps the shape off graphs for good)
        with _gpu_graphs.preparing(steps) as claimed, torch.set_grad_enabled(grad):
            dummy = x.new_zeros(1, batch, features, requires_grad=grad and x.requires_grad)
            states = tuple(x.new_zeros(module.num_layers * dirs, batch, size) for size in module._state_sizes())
            # the parameters' values through aliases: the user's hooks on them never see this run's
            # gradients (the loops copy the values into their buffers, so the captures are the same)
            layers = [[{k: w.detach().requires_grad_(w.requires_grad) for k, w in d.items()} for d in layer]
                      for layer in module._layer_parameters()]
            out, final = engine(dummy, states, layers, None, module.options, dropout=0.0, training=module.training)
            if grad:
                inputs = [w for layer in layers for d in layer for w in d.values() if w.requires_grad]
                inputs += [dummy] if dummy.requires_grad else []
                total = out.float().sum() + sum(f.float().sum() for f in final)
                torch.autograd.grad(total, inputs, allow_unused=True)
    except Exception as e:  # a failing speed path falls back, it does not fail the call
        warnings.warn(f"fastlayers: capturing the time loops of a plain {module.mode} failed ({type(e).__name__}: "
                      f"{e}); such calls stay on torch's kernels", RuntimeWarning, stacklevel=4)
        _UNREADY.add(sig)
        return
    if _gpu_graphs.stats["failed"] != failed or not claimed:
        _UNREADY.add(sig)
        return
    _READY[sig] = (_gpu_graphs.generation, min(claimed))
    while len(_READY) > _READY_KEYS:
        _READY.popitem(last=False)


def _engine(cell, input, hx, layers, lengths, options, dropout, training, masks, varlen=None):
    # input (T, B, F), or (D, T, B, F) for one layer whose directions read inputs of their own
    # (direction d's row (t, b) read as the layer's row (t, b) would be: the reverse direction runs
    # t from len_b - 1 down to 0; what _remat runs a segment's directions with, in one call); or the
    # varlen form's (N, F)
    dirs = len(layers[0])
    dev = input.device
    if varlen is not None:  # no padding to skip or zero: every row is a value row
        return _layers(cell, input, hx, layers, options, dropout, training, masks, varlen.lengths.to(dev),
                       varlen.batch, (dirs, varlen.steps, varlen.batch), Varlen.of(varlen, dev))
    steps, batch = input.shape[-3:-1]
    if input.dim() == 4 and (len(layers) != 1 or input.size(0) != dirs):
        raise ValueError(f"input: a (D, T, B, F) input is for one layer of D = {dirs} directions, got shape "
                         f"{tuple(input.shape)} for {len(layers)} layer(s)")
    # lengths (validated, CPU int64) are data of the kernels; the loops run up to the longest one
    # only (the steps after every sequence's end change nothing), and a batch of equal lengths
    # needs none (the kernels then take all T)
    lens, longest = None, steps
    if lengths is not None:
        longest = int(lengths.max())
        if not bool((lengths == longest).all()):
            lens = lengths.to(dev, non_blocking=True)
    x = input[..., :longest, :, :]
    if lens is not None:  # padding is never read: zeros there keep NaN / inf out of dW_ih = dpre^T x
        x = x.masked_fill((torch.arange(longest, device=dev).unsqueeze(1) >= lens).unsqueeze(2), 0)
    x, finals = _layers(cell, x, hx, layers, options, dropout, training, masks, lens, batch, (dirs, steps, batch),
                        None, longest)
    if longest < steps:  # the rows after every sequence's end: zeros, as the packed path's output
        x = F.pad(x, (0, 0, 0, 0, 0, steps - longest))
    return x, finals


def _between_layers(x: Tensor, p: float, steps: int | None) -> Tensor:
    """Training dropout between layers on x (longest, B, W), the first rows of the call's ``steps``:
    its mask drawn over all ``steps`` rows, as a call that runs them all draws it (``checkpoint_every``'s
    segments, :mod:`._remat`), so that the same seed gives the same masks with and without it."""
    if steps is None or x.size(-3) == steps:
        return F.dropout(x, p, True)
    mask = F.dropout(x.new_ones(*x.shape[:-3], steps, *x.shape[-2:]), p, True)
    return x * mask[..., :x.size(-3), :, :]


def _layers(cell, x, hx, layers, options, dropout, training, masks, lens, batch, zoneout_rows, varlen,
            longest=None):
    """The layers of one call, each one autograd Function over all its directions: x (T, B, F) (or
    (D, T, B, F)) cut to the longest length, or varlen (N, F) with ``varlen`` a :class:`Varlen`;
    zoneout masks drawn as (*zoneout_rows, width) (or given) and cut to ``longest`` steps, or, varlen,
    taken to the value rows (given ones are there already)."""
    dirs = len(layers[0])
    gates = 4 if cell == "LSTM" else 3
    hidden = layers[0][0]["weight_hh"].size(0) // gates
    out_size = layers[0][0]["weight_hr"].size(0) if "weight_hr" in layers[0][0] else hidden
    z_h, z_c = options.zoneout
    ln, peep = options.layer_norm, options.peephole
    finals: list[list[Tensor]] = [[] for _ in hx]
    for li, dir_params in enumerate(layers):
        stack = lambda name, use=True: stack_directions([p[name] for p in dir_params]) if use else None  # noqa: E731
        has_bias, bias = input_bias(cell, dir_params, stack)
        m = (masks[li] if masks is not None else None) or {}
        # drawn in the layout of given masks: (D, B, P); zoneout (D, T, B, width), original time and
        # batch order, as the kernels read them; varlen: drawn so too (the padded call's masks from
        # the same seed), then kept on the value rows (D, N, width), as the kernels read them there
        drawn = drawn_masks(cell, options, training, m, (dirs, batch, out_size), zoneout_rows, hidden, out_size, x)
        if varlen is not None:
            drawn = {k: torch.stack([jagged.unpad(v, varlen.plan) for v in t]) if k.startswith("zoneout") else t
                     for k, t in drawn.items()}
        m = {**m, **drawn}
        rmask = m.get("recurrent")
        zmasks = [m[key][:, :longest] if key in m else None for key in ("zoneout_c", "zoneout_h")]  # varlen: all
        k = slice(li * dirs, (li + 1) * dirs)
        if cell == "LSTM":
            consts = (options.cell_clip or 0.0, 0.0 if training else z_c, 0.0 if training else z_h,
                      options.proj_clip or 0.0)
            y, *last = LSTMLayer.apply(
                x, stack("weight_ih"), stack("ln_ih_weight", ln), bias, hx[0][k], hx[1][k], stack("weight_hh"),
                stack("ln_hh_weight", ln), stack("ln_cell_weight", ln), stack("ln_cell_bias", ln),
                stack("weight_peephole", peep), stack("weight_hr", "weight_hr" in dir_params[0]),
                rmask, zmasks[0], zmasks[1], lens, consts, varlen)
        else:
            y, *last = GRULayer.apply(x, stack("weight_ih"), stack("ln_ih_weight", ln), bias, hx[0][k],
                                      stack("weight_hh"), stack("bias_hh", has_bias), stack("ln_hh_weight", ln), rmask,
                                      zmasks[1], lens, (0.0 if training else z_h,), varlen)
        x = y
        if dropout > 0 and training and li < len(layers) - 1:
            if varlen is not None:  # the padded call's mask (T, B, W) from the same seed, on the value rows
                plan = varlen.plan
                x = x * jagged.unpad(F.dropout(x.new_ones(plan.steps, plan.batch, x.size(-1)), dropout, True), plan)
            else:
                x = _between_layers(x, dropout, zoneout_rows[1])
        for acc, s in zip(finals, last):
            acc.append(s)
    return x, tuple(torch.cat(f) if len(f) > 1 else f[0] for f in finals)
