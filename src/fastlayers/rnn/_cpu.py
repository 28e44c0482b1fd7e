"""The recurrent engine: LSTM with cell options at vendor speed, hand-written backward.

Legend: T time, B batch (sorted longest first), F input features, H hidden size, G = 4H,
D directions, L layers, N = sum of the lengths (the valid rows of one direction).

Everything runs on *packed* rows (:mod:`._lengths`): the valid (t, b) of the length-sorted batch,
step after step, so step t's rows are a contiguous block of the still-active prefix, as in a
PackedSequence; the reverse direction's rows read each sequence back to front from its own last
step. Per layer: the valid input rows of both directions, read from the padded input through
their index where the large products run on ``_native/matmul.c`` (the projection, dX and dW_ih
take the rows block by block; no packed copy is made or saved), else one gather;
:class:`LSTMRecurrence` (:class:`GRURecurrence`) then projects all of them with one batched
GEMM and runs the time loop with one batched recurrent GEMM (both directions) and one fused C
pointwise kernel per step
(``_native/lstm.c``, ``gru.c``; the kernel also applies the input LayerNorm, its gain and the
bias). Its backward runs the per-step kernel and recurrent GEMM in reverse, and computes the
input and weight gradients and the LayerNorm / peephole parameter gradients as large GEMMs and
reductions after the loop. The output is scattered back to the padded (T, B, D*H) layout with
one index_copy. Padding costs nothing: no GEMM, kernel or reduction touches a padded row. The
per-row buffers saved for the backward come from :mod:`fastlayers._core.pool` and are reused by the
next call; the tensors that leave (the gathered rows, the output, their gradients: :mod:`._rows`)
come from its CPU block cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._core import precision
from ._lengths import LengthPlan, full_plan, make_plan
from ._common import draws, drawn_masks, input_bias, stack_directions
from ._options import CellOptions
from ._cpu_recurrence import own_bf16, reads_rows
from ._ops_compile import run_layer
from ._rows import gather, scatter


def lstm_engine(
    input: Tensor,
    hx: tuple[Tensor, Tensor],
    layers: list[list[dict[str, Tensor]]],
    lengths: Tensor | None,
    options: CellOptions,
    *,
    dropout: float = 0.0,
    training: bool = False,
    masks: list[dict[str, Tensor]] | None = None,
    plan: LengthPlan | None = None,
) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """Multi-layer (bidirectional) LSTM with cell options over a time-major padded batch.

    Args:
        input: (T, B, F). hx: (h_0 (L*D, B, P), c_0 (L*D, B, H)); P = proj_size, or H without.
        layers: per layer, per direction, a dict of parameters: ``weight_ih`` (G, F_l),
            ``weight_hh`` (G, P), optional ``bias_ih``/``bias_hh`` (G); with layer_norm
            ``ln_ih_weight``, ``ln_hh_weight`` (G), ``ln_cell_weight``, ``ln_cell_bias`` (H);
            with peephole ``weight_peephole`` (3H, order i, f, o); with a projection
            ``weight_hr`` (P, H).
        lengths: (B,) CPU int64 (validated) or None (all T).
        options: :class:`CellOptions`.
        masks: optional per-layer dict with ``recurrent`` (D, B, P), ``zoneout_h`` (D, T, B, P)
            and ``zoneout_c`` (D, T, B, H) keep-masks in original time and batch order (tests pass
            them to compare with the reference); sampled here in training when None.
        plan: the varlen form instead (issue 66): ``input`` (N, F), the sequences one after another,
            and the plan of their rows (``make_plan(lengths, T, False, device, varlen=True)``,
            ``lengths`` then the same lengths); the output is (N, D*P), no padded tensor made.
            Given zoneout masks are then (D, N, width), in the values' row order.

    Returns:
        output (T, B, D*P) with zeros at t >= len_b; h_n (L*D, B, P), c_n (L*D, B, H), torch's
        packed semantics.
    """
    return _engine("LSTM", input, hx, layers, lengths, options, dropout, training, masks, plan)


def gru_engine(
    input: Tensor,
    hx: tuple[Tensor],
    layers: list[list[dict[str, Tensor]]],
    lengths: Tensor | None,
    options: CellOptions,
    *,
    dropout: float = 0.0,
    training: bool = False,
    masks: list[dict[str, Tensor]] | None = None,
    plan: LengthPlan | None = None,
) -> tuple[Tensor, tuple[Tensor]]:
    """Multi-layer (bidirectional) GRU with cell options (layer_norm, zoneout z_h, recurrent_dropout).

    As :func:`lstm_engine` with one state: hx = (h_0,) (L*D, B, H); parameters ``weight_ih``
    (3H, F_l), ``weight_hh`` (3H, H), optional ``bias_ih``/``bias_hh`` (3H), with layer_norm
    ``ln_ih_weight``, ``ln_hh_weight`` (3H); masks ``recurrent`` (D, B, H), ``zoneout_h``
    (D, T, B, H). Returns output (T, B, D*H) and (h_n,).
    """
    return _engine("GRU", input, hx, layers, lengths, options, dropout, training, masks, plan)


def layer_plan(lengths: Tensor | None, steps: int, batch: int, device: torch.device) -> LengthPlan:
    """The packing this engine runs a call with: by the lengths, else every row of every step."""
    return make_plan(lengths, steps, False, device) if lengths is not None else full_plan(steps, batch, device)


def given_layout(drawn: dict[str, Tensor], plan: LengthPlan, steps: int, batch: int) -> dict[str, Tensor]:
    """Masks this engine drew (:func:`drawn_masks` with its shapes: recurrent (D, B, P), used in
    length-sorted batch order; zoneout (D, N, width) on the packed rows of ``plan``) in the layout of
    given masks, which :func:`_cpu` moves back to exactly these: recurrent (D, B, P) in original
    batch order, zoneout (D, T, B, width) in original time and batch order (zeros at the padding,
    which no step reads)."""
    out: dict[str, Tensor] = {}
    for key, mask in drawn.items():
        dirs = mask.size(0)
        if key == "recurrent":
            out[key] = torch.empty_like(mask).index_copy_(1, plan.sorted_indices, mask)
            continue
        flat = mask.new_zeros(dirs, steps * batch, mask.size(-1))
        for d, rows in enumerate((plan.forward_rows, plan.reverse_rows)[:dirs]):
            flat[d].index_copy_(0, rows, mask[d])
        out[key] = flat.view(dirs, steps, batch, -1)
    return out


def engine_draws(cell: str, options: CellOptions, training: bool, given: dict[str, Tensor], x: Tensor,
                 lengths: Tensor | None, sizes: tuple[int, int, int, int, int]) -> dict[str, Tensor]:
    """One layer's masks that ``given`` lacks, drawn as this engine draws them when it runs the layer
    with input ``x`` (:func:`drawn_masks` over the packed rows of its plan, in this order), in the
    layout of given masks (:func:`given_layout`). ``sizes``: (D, T, B, width, hidden). Callers that
    run the same layer otherwise (:mod:`._remat`'s segments, the operators of a call without
    autograd) draw through this, so a seed gives the same masks on each."""
    if not draws(options, training):
        return {}  # nothing to draw: no packing plan to build
    dirs, steps, batch, width, hidden = sizes
    plan = layer_plan(lengths, steps, batch, x.device)
    rows = sum(span * n for span, n in plan.segments)
    drawn = drawn_masks(cell, options, training, given, (dirs, batch, width), (dirs, rows), hidden, width,
                        mask_like(x, precision.Products.of(x)))
    return given_layout(drawn, plan, steps, batch)


def varlen_engine_draws(cell: str, options: CellOptions, training: bool, x: Tensor, cu_seqlens: Tensor,
                        sizes: tuple[int, int, int, int]) -> dict[str, Tensor]:
    """One varlen layer's masks (values ``x`` (N, F), ``cu_seqlens`` (B+1,)) drawn as this engine
    draws them when it runs the layer eagerly (:func:`drawn_masks` over its packed rows, in this
    order), in the layout the varlen operators take: recurrent (D, B, P) in batch order, zoneout
    (D, N, width) on the value rows. Tensor operations only, no length read on the host (so
    torch.compile traces it with N and B dynamic): a compiled varlen call draws the eager call's
    masks. ``sizes``: (D, B, width, hidden)."""
    if not draws(options, training):
        return {}
    dirs, batch, width, hidden = sizes
    rows = x.size(0)
    drawn = drawn_masks(cell, options, training, {}, (dirs, batch, width), (dirs, rows), hidden, width,
                        mask_like(x, precision.Products.of(x)))
    cu = cu_seqlens.to(x.device, torch.int64)
    lengths = cu[1:] - cu[:-1]
    order = torch.sort(lengths, descending=True, stable=True).indices  # (as make_plan's)
    position = torch.empty_like(order).scatter_(0, order, torch.arange(batch, device=x.device))
    ascending = torch.sort(lengths).values
    before = torch.cat([ascending.new_zeros(1), ascending.cumsum(0)])

    def packed_before(step: Tensor) -> Tensor:  # rows packed before step s: sum_b min(len_b, s)
        shorter = torch.searchsorted(ascending, step)  # (sequences with len_b < s)
        return before[shorter] + step * (batch - shorter)

    value = torch.arange(rows, device=x.device)
    seq = torch.searchsorted(cu[1:], value, right=True)  # each value row's sequence and step
    step = value - cu[seq]
    steps = (step, lengths[seq] - 1 - step)[:dirs]  # the reverse direction reads step len - 1 - s
    packed = [packed_before(s) + position[seq] for s in steps]  # (N,) each: value row -> its packed row
    out: dict[str, Tensor] = {}
    for key, mask in drawn.items():
        out[key] = (mask.index_select(1, position) if key == "recurrent"
                    else torch.stack([mask[d].index_select(0, packed[d]) for d in range(dirs)]))
    return out


def mask_like(x: Tensor, mm: precision.Products) -> Tensor:
    """What the C engine draws a layer's masks like (dtype, device): x, or where the call's products
    take x in a low dtype, an empty tensor of it (also where x stays float32 for the own bf16 kernel:
    a recurrent mask's 1 / keep is rounded to that dtype; :mod:`._remat` draws through this too)."""
    return x.new_empty(0, dtype=mm.low) if mm.lowered and x.dtype != mm.low else x


def _engine(cell, input, hx, layers, lengths, options, dropout, training, masks, varlen=None):
    gates = 4 if cell == "LSTM" else 3
    dirs = len(layers[0])
    hidden = layers[0][0]["weight_hh"].size(0) // gates
    proj = "weight_hr" in layers[0][0]
    out_size = layers[0][0]["weight_hr"].size(0) if proj else hidden
    dev = input.device
    if varlen is None:
        steps, batch, _ = input.shape
        plan, num_rows = layer_plan(lengths, steps, batch, dev), steps * batch  # rows of the input / output layout
    else:  # (N, F): the sequences one after another, no padding anywhere
        assert lengths is not None
        batch, plan, num_rows = lengths.numel(), varlen, varlen.num_rows
    if lengths is None and torch.compiler.is_compiling():  # every step all B rows: a tensor, so that T and B
        active: tuple[int, ...] | Tensor = torch.full((steps,), batch, dtype=torch.int64)  # stay symbolic
        rows = steps * batch
    else:
        active = tuple(n for span, n in plan.segments for _ in range(span))
        rows = sum(active)
    # packed row k of direction d reads padded row src[d, k] of the (T*B, ...) input; the output
    # of direction d goes to column block d of padded row src[d, k]
    src = torch.stack([plan.forward_rows, plan.reverse_rows][:dirs])  # (D, N)
    order = plan.sorted_indices
    # without lengths the plan is the identity (batch order, packed rows = padded rows of each step):
    # no gathers then, and for one direction no scatter either
    identity = lengths is None
    states = list(hx) if identity else [s.index_select(1, order) for s in hx]  # (h_0,) or (h_0, c_0), sorted batch
    dst = None  # the output's padded rows (one scatter per layer), made where the packing is not the identity
    finals: list[list[Tensor]] = [[] for _ in states]
    x = input
    mm = precision.Products.of(input)
    # float32 under autocast with hardware bf16/fp16 GEMMs: converted once, before the gather (half the
    # bytes gathered; later layers get low inputs), unless the projection and its input gradient run on
    # matmul.c's bf16 kernel (own_bf16): the Function converts into its own pooled copy then, and the
    # input gradient comes back in float32 with no conversion of a new tensor either way
    if mm.lowered and x.dtype != mm.low and not own_bf16(mm, rows):
        x = x.to(mm.low)
    for li, dir_params in enumerate(layers):
        # the valid rows of both directions: the padded rows and their index (packed_layer gathers
        # them where the Function does not read them itself); the Function projects them (one GEMM)
        xs, rows_of = (x.reshape(1, rows, -1), None) if identity and dirs == 1 else (x.reshape(num_rows, -1), src)
        m = (masks[li] if masks is not None else None) or {}
        # drawn masks are used as drawn: the recurrent one in length-sorted batch order, zoneout on the
        # packed rows; given ones (original order, :func:`given_layout` makes drawn ones so) are moved there
        drawn = drawn_masks(cell, options, training, m, (dirs, batch, out_size), (dirs, rows), hidden, out_size,
                            mask_like(x, mm))
        rmask = m["recurrent"].index_select(1, order).contiguous() if "recurrent" in m else drawn.get("recurrent")
        zmasks = []
        for key, width in (("zoneout_c", hidden), ("zoneout_h", out_size)):
            zm = m.get(key)
            if zm is not None:  # (D, T, B, width) in original time and batch order -> packed rows
                zm = torch.stack([zm[d].reshape(num_rows, width).index_select(0, src[d]) for d in range(dirs)])
            zmasks.append(zm if zm is not None else drawn.get(key))
        k = slice(li * dirs, (li + 1) * dirs)
        y, last = packed_layer(cell, xs, dir_params, tuple(s[k] for s in states), rmask, zmasks[0], zmasks[1], active,
                               options, training, rows_of)
        # back to the padded layout: one scatter of both directions, zeros at t >= len_b
        if identity and dirs == 1:
            x = y.view(steps, batch, out_size)
        else:
            if dst is None:
                dst = (src * dirs + torch.arange(dirs, device=dev).unsqueeze(1)).flatten()
            # (every row is written when all rows are valid: no zero fill then)
            x = scatter(y.reshape(dirs * rows, out_size), dst, num_rows * dirs, rows == num_rows)
            x = x.view(num_rows, dirs * out_size) if varlen is not None else x.view(steps, batch, dirs * out_size)
        if dropout > 0 and training and li < len(layers) - 1:
            x = F.dropout(x, dropout, True)
        for acc, s in zip(finals, last):
            acc.append(s)
    unorder = plan.unsorted_indices
    return x, tuple(torch.cat(f) if identity else torch.cat(f).index_select(1, unorder) for f in finals)


def packed_layer(cell: str, xs: Tensor, dir_params: list[dict[str, Tensor]], states: tuple[Tensor, ...],
                 rmask: Tensor | None, zc: Tensor | None, zh: Tensor | None, active: tuple[int, ...] | Tensor,
                 options: CellOptions, training: bool, src: Tensor | None = None) -> tuple[Tensor, tuple[Tensor, ...]]:
    """One layer, every direction, on packed rows (:class:`LSTMRecurrence` / :class:`GRURecurrence`).

    xs (D, N, F_l) the packed input rows (step after step, each step's rows the active prefix of the
    length-sorted batch), or with ``src`` (D, N) int64 the padded rows (R, F_l) whose rows src[d] they
    are (gathered here unless the Function reads them itself: :func:`._cpu_recurrence.reads_rows`);
    ``dir_params`` per direction as :func:`lstm_engine`'s; states (h (D, B, P),
    c (D, B, H)) or (h (D, B, H),) in the sorted batch; rmask (D, B, P) sorted, zc (D, N, H), zh (D,
    N, P) packed keep-masks, or None; ``active`` the T active-prefix sizes (sum N). Returns y (D, N,
    P) and the final states (D, B, width), sorted. Each direction runs forward over its rows: the
    caller's gather decides which time they are (the engine reads the reverse direction's back to
    front). The directions' parameters are stacked by :func:`._common.stack_directions` (no copy
    where they are the rows of one stacked tensor)."""
    def stack(name: str, use: bool = True) -> Tensor | None:
        return stack_directions([p[name] for p in dir_params]) if use else None

    has_bias, bias = input_bias(cell, dir_params, stack)
    w_ih = stack("weight_ih")
    if src is not None and not reads_rows(precision.Products.of(xs), src, xs, w_ih, bias):
        # one gather (every row of the input is one of the first direction's when all rows are valid)
        xs, src = gather(xs, src.flatten(), src.size(1) == xs.size(0)).view(*src.shape, -1), None
    ln, peep, proj = options.layer_norm, options.peephole, "weight_hr" in dir_params[0]
    z_h, z_c = options.zoneout
    if cell == "LSTM":
        consts = (options.cell_clip or 0.0, 0.0 if training else z_c, 0.0 if training else z_h,
                  options.proj_clip or 0.0)
        y, *last = run_layer(
            "LSTM", xs, w_ih, stack("ln_ih_weight", ln), bias, states[0], states[1],
            stack("weight_hh"), stack("ln_hh_weight", ln), stack("ln_cell_weight", ln), stack("ln_cell_bias", ln),
            stack("weight_peephole", peep), stack("weight_hr", proj), rmask, zc, zh, active, consts, src=src)
    else:
        y, *last = run_layer("GRU", xs, w_ih, stack("ln_ih_weight", ln), bias, states[0],
                             stack("weight_hh"), stack("bias_hh", has_bias), stack("ln_hh_weight", ln), rmask,
                             zh, active, (0.0 if training else z_h,), src=src)
    return y, tuple(last)
