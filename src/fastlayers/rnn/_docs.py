"""The recurrent modules' docstrings, shared by LSTM, GRU and RNN (:mod:`._modules` builds each
class's ``__doc__`` from these templates): the shape legend, inputs and outputs, devices and
precision, and the cell options' documentation (LSTM's and GRU's)."""

COMMON_DOC = """
    Shape legend: T time steps, B batch, F = input_size, H = hidden_size, H_out = proj_size if
    proj_size > 0 else hidden_size (LSTM only; H_out = H for GRU and RNN), L = num_layers,
    D = 2 if bidirectional else 1.

    Forward: ``forward(input, hx=None, *, lengths=None, cu_seqlens=None, max_seqlen=None)`` (the
    varlen form with ``cu_seqlens``: :meth:`forward`).

    * ``input``: (T, B, F) float tensor, (B, T, F) if ``batch_first``, unbatched (T, F), or a
      PackedSequence (then the output is a PackedSequence, exactly as torch).
    * ``hx``: initial state{hx_doc}; zeros if omitted.
    * ``lengths``: optional per-sequence lengths, a 1-D integer tensor on any device, a 1-D integer
      NumPy array or a sequence of B ints (Python's or NumPy's), ``1 <= lengths[b] <= T``, any
      order, duplicates allowed (for unbatched input: one length, as ``[n]`` or a (1,) tensor).
      Semantics are exactly those of torch's PackedSequence path: output rows at
      ``t >= lengths[b]`` are zero; the final state of the forward direction is taken after each
      sequence's own last step, that of the reverse direction after t = 0, and the reverse
      direction starts at each sequence's own last step.

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
    shape or rank; ValueError for a wrong input rank. ``lengths`` as torch's ``pack_padded_sequence``
    refuses them (its class, its message first where it has one): ValueError and RuntimeError for
    lengths outside [1, T] (under torch.compile / torch.export, checked in the graph: RuntimeError,
    the bound broken named); ValueError, RuntimeError and IndexError for lengths of another shape
    than (B,) (a 0-D tensor or an int: torch's ``'lengths' argument should be a 1D ...``);
    TypeError and ValueError for non-integer elements. Ours only: TypeError for float ``lengths``
    (torch truncates them), ValueError for ``lengths`` with PackedSequence input; for
    an unbatched input an LSTM ``hx`` of more than two states (torch.nn.LSTM reads
    hx[0] and hx[1] and ignores the rest), RuntimeError (a stacked (2, L*D, H_out) tensor it takes,
    as torch does). Under ``torch.autocast``, bfloat16 / float16 parameters take a float32 (or the
    other low dtype's) ``input`` and ``hx`` as torch.nn's modules do, converted to the parameters'
    dtype: the call runs as that low-precision model's without autocast, results in the parameters'
    dtype (torch.nn.LSTM's and RNN's are in the autocast dtype where the two differ, torch.nn.GRU's
    in float32).

    Non-finite input: no kernel assumes finite values. A NaN in ``input`` at (t, b) makes NaN
    exactly the outputs and final states that depend on it, as the float64 reference does:
    sequence b from step t on (forward direction), up to step t (reverse direction), and what
    later layers compute from those; other sequences stay finite. +-inf saturates the gates
    (the sigmoid / tanh limits, as torch) and becomes NaN where a LayerNorm subtracts it from
    itself. Values at padded steps (t >= lengths[b]) are never read, on any backend: outputs and
    gradients are those of zero padding, and the input's gradient there is 0. Inputs of size 1e4
    keep every output, state and gradient finite (gates saturate; LayerNorm normalises).

    Initialisation (``reset_parameters()``, called once by the constructor): torch's rule,
    uniform(-1/sqrt(H), 1/sqrt(H)), for every weight and bias; with options see below.
    Construction on ``device="meta"`` then ``to_empty(device=...)`` and ``reset_parameters()``
    gives the parameters a normal construction gives after the same ``torch.manual_seed``.

    Mirrors :class:`torch.nn.{name}` (same constructor arguments, parameter names and shapes;
    ``load_state_dict(strict=True)`` works in both directions); the ``repr`` adds what torch's
    leaves out (the cell options, ``checkpoint_every``, an RNN's ``nonlinearity='relu'``).
"""


OPTIONS_DOC = """
    Cell options (keyword-only; all off = torch.nn.LSTM math on torch's kernels; any on = the
    fastlayers engine, see :mod:`fastlayers.rnn._cpu`), per layer and direction, gates i, f, g, o:

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

    * ``checkpoint_every=k`` (an int >= 1, or ``"auto"`` for about sqrt(T / D), on CPU at least
      ceil(1280 / B) while that leaves 16 segments; default None):
      recomputation through time for long sequences (:mod:`._remat`). In a call that records
      gradients, each layer and direction runs as segments of k steps; the forward keeps only the
      state entering each segment (and the masks it drew), the backward runs each segment again
      from it. Memory about (T/k + k) states per layer instead of every step's activations, for
      one more forward; the same gradients up to the order of sums. Not a parameter nor in
      ``state_dict``; with it on, a call without options runs the engine too.

    PackedSequence input: without options, torch's own packed call (exactly torch.nn's numbers;
    the ``lengths=`` call equals them up to the order of sums, about 1e-7 in float32);
    with options, run as its padded batch with ``lengths=`` (the same call, the same numbers), the
    output packed again as torch returns it (the input's batch_sizes and indices). Bad option values raise
    ValueError/TypeError naming the option. ``cell(layer, direction)`` returns a step-wise cell
    sharing the weights (eval semantics) for decoding one step at a time.

    Devices: on CPU the engine's C kernels; on CUDA the GPU engine (:mod:`._gpu`, Triton
    step kernels and step GEMMs, cuBLAS for the rest) whose time loops run as a chunk of steps
    captured in a CUDA graph once per batch size and dtype and replayed for any T (a longer T
    than any before captures again, with larger buffers; :mod:`._gpu_graphs`;
    ``FASTLAYERS_CUDA_GRAPHS=0`` keeps them eager).
"""


GRU_OPTIONS_DOC = """
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

    PackedSequence input: without options torch's own packed call, with options as its padded
    batch with ``lengths=``, the output packed again as torch returns it. Bad option values raise ValueError/TypeError
    naming the option. ``cell(layer, direction)`` returns a step-wise cell sharing the weights.
"""
