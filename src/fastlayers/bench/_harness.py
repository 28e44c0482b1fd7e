"""Verified comparison: prove candidates compute the same function and gradients, then time them.

For every candidate: forward and forward+backward wall time (median and spread over interleaved
repeats after a warm-up that lasts until the times settle; a sub-millisecond candidate is timed
over enough back-to-back calls per measurement to last ``block_s``; CUDA synchronised),
backward/forward ratio, peak memory of one
forward+backward call, and the max relative error of the output and of every gradient against a
reference (default: the first candidate evaluated in float64). Flags: ``value mismatch``,
``gradient mismatch: <name>``, ``missing gradient: <name>``, ``unchecked gradient: <name>``,
``cliff`` (:data:`FAILURES`: the kinds that say a candidate does not compute the reference's
function; a non-finite value or gradient where the reference's is finite is a mismatch).
Gradients are named ``input:<name>``, ``param:<name>`` (an ``nn.Module``'s parameters) and
``closure:<i>[<shape>]``: the tensors a plain callable holds in its closure (the leaves its
backward accumulates into that are neither inputs nor a module's parameters), matched with the
reference's: the same tensor where both hold it, else by shape, in the order of the autograd
graph among equal shapes.
"""

from __future__ import annotations

import copy
import gc
import io
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import Tensor, nn

from .._core.system import cpu_name

Candidate = Callable[..., Any]

# the flag kinds that say a candidate does not compute the reference's function and gradients (the
# command line exits non-zero on one a workload does not expect); "cliff" is a speed remark
FAILURES = ("value mismatch", "gradient mismatch", "missing gradient", "unchecked gradient")


@dataclass(frozen=True)
class Inputs:
    """What ``make_inputs`` returned: positional ``args`` and keyword ``kwargs`` of every call."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @classmethod
    def of(cls, value: object) -> "Inputs":
        if isinstance(value, Mapping):
            return cls((), dict(value))
        if isinstance(value, (tuple, list)):
            return cls(tuple(value), {})
        raise TypeError(f"make_inputs: expected it to return a dict (keyword arguments) or a tuple/list (positional "
                        f"arguments) of tensors, got {type(value).__name__}")

    def call(self, fn: Candidate) -> Any:
        return fn(*self.args, **self.kwargs)

    def named(self) -> dict[str, Any]:
        """Every input by name: the keyword, or the position for positional ones."""
        return {**{str(i): a for i, a in enumerate(self.args)}, **self.kwargs}

    def map(self, f: Callable[[Any], Any]) -> "Inputs":
        return Inputs(tuple(f(a) for a in self.args), {k: f(v) for k, v in self.kwargs.items()})


@dataclass
class CandidateResult:
    """Measurements of one candidate. Times in seconds, memory in bytes, errors relative.

    Attributes:
        name: the candidate's name (a key of ``candidates``).
        forward_s, forward_backward_s: the timed repeats, seconds per call (each the mean of
            ``calls`` back-to-back calls).
        peak_memory_bytes: peak memory of one forward + backward above what was allocated before
            it, bytes (None: not measured).
        output_error: ``max |got - ref| / max |ref|`` of the outputs against the reference (None:
            the reference itself, or not checked).
        grad_errors: the same relative error per gradient (keys ``input:<name>``, ``param:<name>``
            and ``closure:<i>[<shape>]``; inf for a missing gradient).
        flags: ``"value mismatch"``, ``"gradient mismatch: <name>"``, ``"missing gradient: <name>"``
            (none, or all zero, where the reference's is not), ``"unchecked gradient: <name>"`` (a
            gradient the reference has no counterpart of, or of a reference parameter a plain-callable
            candidate cannot name; for closure tensors: one without a counterpart of its shape that
            receives a non-zero gradient, on either side), ``"cliff"``; empty when all is well (also
            when no check ran: the report's ``checked``).
        calls: back-to-back calls per measurement, forward and forward + backward.
    """

    name: str
    forward_s: list[float] = field(default_factory=list)
    forward_backward_s: list[float] = field(default_factory=list)
    peak_memory_bytes: int | None = None
    output_error: float | None = None
    grad_errors: dict[str, float] = field(default_factory=dict)
    flags: list[str] = field(default_factory=list)
    calls: list[int] = field(default_factory=lambda: [1, 1])  # back-to-back calls per measurement: fwd, fwd+bwd

    @property
    def forward_median(self) -> float:
        """The median of :attr:`forward_s`, seconds per call (NaN when nothing was timed)."""
        return statistics.median(self.forward_s) if self.forward_s else float("nan")

    @property
    def forward_backward_median(self) -> float:
        """The median of :attr:`forward_backward_s`, seconds per call (NaN when nothing was timed)."""
        return statistics.median(self.forward_backward_s) if self.forward_backward_s else float("nan")

    def failures(self) -> list[str]:
        """The flags of the :data:`FAILURES` kinds."""
        return [f for f in self.flags if f.partition(": ")[0] in FAILURES]

    @property
    def backward_ratio(self) -> float:
        """(forward+backward) / forward, medians."""
        return self.forward_backward_median / self.forward_median

    @staticmethod
    def spread(times: list[float]) -> float:
        """(max - min) / median of the repeats, a unit-free spread."""
        return (max(times) - min(times)) / statistics.median(times) if len(times) > 1 else 0.0


@dataclass
class Report:
    """A plain record of one comparison: environment, settings and per-candidate results
    (``report["name"]`` is a candidate's :class:`CandidateResult`; KeyError naming the candidates
    for an unknown one).

    Attributes:
        workload, dtype, device, threads, torch_version, cpu: what ran, where (``cpu``: the CPU's
            model name).
        repeats, warmup, reference, cliff_threshold: the settings of :func:`compare`.
        results: one :class:`CandidateResult` per candidate, in the order given.
        notes: remarks for the reader (e.g. a candidate's input layout).
        checked: whether values and gradients were compared (``compare(check=False)``: times only;
            the flags column then says "not checked").
        anchor: the candidate the ratios are against (None: the first), kept so that a report read
            back from JSON prints the same ratios.
        expected: candidate name -> the flag kinds it is built to get (a workload's speed anchor
            that computes another function); :meth:`unexpected` leaves them out.
    """

    workload: str
    dtype: str
    device: str
    threads: int
    torch_version: str
    cpu: str
    repeats: int
    warmup: int
    reference: str
    cliff_threshold: float
    results: list[CandidateResult]
    notes: list[str] = field(default_factory=list)
    checked: bool = True
    anchor: str | None = None
    expected: dict[str, list[str]] = field(default_factory=dict)

    def __getitem__(self, name: str) -> CandidateResult:
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(f"candidate: expected one of {[r.name for r in self.results]}, got {name!r}")

    def ratio(self, name: str, anchor: str, which: str = "forward_backward") -> float:
        """Median time of ``name`` over that of ``anchor`` (``which``: forward or forward_backward)."""
        return getattr(self[name], f"{which}_median") / getattr(self[anchor], f"{which}_median")

    def unexpected(self, result: CandidateResult) -> list[str]:
        """``result``'s flags but for the kinds :attr:`expected` lists for it."""
        expected = self.expected.get(result.name, ())
        return [f for f in result.flags if f.partition(": ")[0] not in expected]

    def failed(self, result: CandidateResult) -> list[str]:
        """``result``'s failed checks (:meth:`CandidateResult.failures`) that :attr:`expected` does
        not list for it: what makes a benchmark exit 1."""
        return [f for f in self.unexpected(result) if f.partition(": ")[0] in FAILURES]

    def to_json(self, indent: int | None = 2) -> str:
        """The report as strict JSON (:meth:`from_json` reads it back); times in seconds, memory in
        bytes. JSON has no infinity or NaN (a missing gradient's error is inf), so a non-finite
        number is written as the string ``"inf"``, ``"-inf"`` or ``"nan"`` (null stays None: not
        measured, or not checked)."""
        return json.dumps(_finite_json(asdict(self)), indent=indent, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> "Report":
        """A report from :meth:`to_json`'s text (also from before ``anchor`` and ``expected`` were
        kept, or when non-finite numbers were written as ``Infinity`` / ``NaN``)."""
        data = json.loads(text)
        data["results"] = [CandidateResult(**_numbers(r, _RESULT_NUMBERS)) for r in data["results"]]
        return cls(**_numbers(data, ("cliff_threshold",)))

    def _rows(self, anchor: str | None) -> list[list[str]]:
        """The formatted cells of every candidate, ratios against ``anchor`` (default: the
        report's :attr:`anchor`, else the first)."""
        base = self[anchor or self.anchor or self.results[0].name]
        rows = []
        for r in self.results:
            errs = [e for e in [r.output_error, *r.grad_errors.values()] if e is not None]
            rows.append([
                r.name,
                f"{r.forward_median * 1e3:.1f}",
                f"{r.forward_backward_median * 1e3:.1f}",
                f"{CandidateResult.spread(r.forward_backward_s):.0%}",
                f"{r.forward_median / base.forward_median:.2f}",
                f"{r.forward_backward_median / base.forward_backward_median:.2f}",
                f"{r.backward_ratio:.1f}",
                "-" if r.peak_memory_bytes is None else f"{r.peak_memory_bytes / 2**20:.1f}",
                f"{max(errs):.1e}" if errs else "-",
                _summarise_flags(r.flags) if self.checked else ", ".join(r.flags + ["not checked"]),
            ])
        return rows

    def table(self, anchor: str | None = None):
        """A rich Table; ratios are against ``anchor`` (default: the report's, else the first candidate)."""
        from rich.table import Table

        t = Table(title=f"{self.workload}: {self.dtype} on {self.device}, {self.threads} threads, "
                        f"torch {self.torch_version}; median of {self.repeats} after {self.warmup} warm-up")
        for col in ("candidate", "fwd ms", "fwd+bwd ms", "spread", "x anchor fwd", "x anchor f+b", "f+b / fwd",
                    "peak MiB", "max rel err", "flags"):
            t.add_column(col, justify="left" if col in ("candidate", "flags") else "right")
        for cells in self._rows(anchor):
            t.add_row(*cells)
        return t

    def markdown(self, anchor: str | None = None) -> str:
        """The table as GitHub markdown (times in ms, ratios against ``anchor``)."""
        rows = [f"{self.workload}: {self.dtype} on {self.device} ({self.cpu}), {self.threads} threads, torch "
                f"{self.torch_version}; median of {self.repeats} after {self.warmup} warm-up; "
                + (f"errors vs {self.reference}" if self.checked else "values and gradients not checked"),
                "",
                "| candidate | fwd ms | fwd+bwd ms | spread | fwd x anchor | fwd+bwd x anchor | f+b / fwd | peak MiB "
                "| max rel err | flags |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        rows += ["| " + " | ".join(cells) + " |" for cells in self._rows(anchor)]
        return "\n".join(rows)

    def render(self, anchor: str | None = None) -> str:
        """The table as plain text (for logs and BENCHMARKS.md)."""
        from rich.console import Console

        console = Console(width=200, record=True, file=io.StringIO())
        console.print(self.table(anchor))
        return console.export_text()


# the fields of a CandidateResult that hold numbers (a number, or lists / dicts of them)
_RESULT_NUMBERS = ("forward_s", "forward_backward_s", "output_error", "grad_errors")


def _finite_json(value: Any) -> Any:
    """``value`` with every non-finite float replaced by its name, ``"inf"``, ``"-inf"`` or ``"nan"``."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_json(v) for v in value]
    return value


def _numbers(data: dict, keys: Iterable[str]) -> dict:
    """``data`` with the named fields' ``"inf"`` / ``"-inf"`` / ``"nan"`` strings read back as
    floats (only number fields: a candidate's name or flag may be any string)."""
    def number(v: Any) -> Any:
        if isinstance(v, str):
            return float(v)
        if isinstance(v, list):
            return [number(x) for x in v]
        if isinstance(v, dict):
            return {k: number(x) for k, x in v.items()}
        return v
    return {k: number(v) if k in keys else v for k, v in data.items()}


def _summarise_flags(flags: list[str]) -> str:
    """One line per flag kind: 'gradient mismatch: input:x (+8 more)'."""
    kinds: dict[str, list[str]] = {}
    for flag in flags:
        kind, _, what = flag.partition(": ")
        kinds.setdefault(kind, []).append(what)
    parts = []
    for kind, whats in kinds.items():
        named = [w for w in whats if w]
        if not named:
            parts.append(kind)
        else:
            parts.append(f"{kind}: {named[0]}" + (f" (+{len(named) - 1} more)" if len(named) > 1 else ""))
    return ", ".join(parts) or "ok"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _outputs(value: Any) -> list[Tensor]:
    """Flatten a candidate's return value to its floating-point tensors."""
    if isinstance(value, Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _outputs(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _outputs(v)]
    if value is None:
        return []
    raise TypeError(f"candidate output: expected tensors (or tuples/lists/dicts of them), got {type(value).__name__}")


def _differentiables(fn: Candidate, inputs: Inputs) -> dict[str, Tensor]:
    named = {f"input:{k}": v for k, v in inputs.named().items() if isinstance(v, Tensor) and v.requires_grad}
    if isinstance(fn, nn.Module):
        named.update({f"param:{k}": p for k, p in fn.named_parameters() if p.requires_grad})
    return named


def _nonzero(grad: Tensor | None) -> bool:
    return grad is not None and bool((grad != 0).any())


def _check_gradients(res: CandidateResult, fn: Candidate, diffs: dict[str, Tensor], ref_grads: dict[str, Any],
                     rtol: float) -> None:
    """Flag ``res`` for every gradient that differs from the reference's, is missing (None or all
    zero where the reference's is not), or cannot be compared (no counterpart by name; closure
    tensors: only where one receives a non-zero gradient, see :func:`_closure_tensors`)."""
    for key, ref_grad in ref_grads.items():
        closure = key.startswith("closure:")
        if key not in diffs and (closure or key.startswith("param:") and not isinstance(fn, nn.Module)):
            if not closure or _nonzero(ref_grad):  # a plain callable's parameters have no names
                res.flags.append(f"unchecked gradient: {key}")
            continue
        got = diffs[key].grad if key in diffs else None
        if _nonzero(ref_grad) and not _nonzero(got):
            res.flags.append(f"missing gradient: {key}")
            res.grad_errors[key] = float("inf")
        elif got is not None:
            res.grad_errors[key] = _rel_err(got, torch.zeros_like(got) if ref_grad is None else ref_grad)
            if not res.grad_errors[key] <= rtol:
                res.flags.append(f"gradient mismatch: {key}")
    for key, t in diffs.items():
        if key not in ref_grads:  # the candidate's own parameters, which the reference has no counterpart of
            if key.startswith("closure:"):  # (a closure tensor with no gradient is no parameter of the function)
                if _nonzero(t.grad):
                    res.flags.append(f"unchecked gradient: {key}")
                continue
            res.flags.append(f"{'unchecked' if _nonzero(t.grad) else 'missing'} gradient: {key}")


def _closure_tensors(outs: list[Tensor], known: Iterable[Tensor]) -> list[Tensor]:
    """The leaves a backward from ``outs`` accumulates into that are not in ``known`` (the inputs
    and a module's parameters): the tensors a plain callable holds in its closure. Sorted by
    shape, in graph order among equal shapes, so that :func:`_closure_names` can pair them with
    the reference's."""
    ids = {id(t) for t in known}
    return sorted((t for t in _graph_leaves(outs) if id(t) not in ids), key=lambda t: tuple(t.shape))


def _closure_names(tensors: list[Tensor], reference: list[Tensor]) -> dict[str, Tensor]:
    """``tensors`` (:func:`_closure_tensors`) by name, ``closure:<i>[<shape>]``: ``i`` the index of
    the ``reference``'s closure tensor they pair with: the same tensor where both hold it (two
    candidates using the same weights in another order), else by shape (the k-th left of a shape
    with the reference's k-th left), or past the reference's for those with no counterpart."""
    def name(i: int, shape: tuple[int, ...]) -> str:
        return f"closure:{i}[{'x'.join(map(str, shape))}]"

    same = {id(t): i for i, t in enumerate(reference)}
    paired = {id(t): same[id(t)] for t in tensors if id(t) in same}
    free: dict[tuple[int, ...], list[int]] = {}
    for i, t in enumerate(reference):
        if i not in paired.values():
            free.setdefault(tuple(t.shape), []).append(i)
    named, extra = {}, len(reference)
    for t in tensors:
        shape = tuple(t.shape)
        if id(t) in paired:
            named[name(paired[id(t)], shape)] = t
        elif free.get(shape):
            named[name(free[shape].pop(0), shape)] = t
        else:
            named[name(extra, shape)] = t
            extra += 1
    return named


def _graph_leaves(outs: list[Tensor], limit: int = 2_000_000) -> list[Tensor]:
    """The leaf tensors a backward from ``outs`` accumulates into (autograd's AccumulateGrad nodes),
    found by walking the graph (at most ``limit`` nodes)."""
    seen: set = set()
    stack = [o.grad_fn for o in outs if o.grad_fn is not None]
    found: dict[int, Tensor] = {}
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, Tensor):
            found[id(variable)] = variable
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(found.values())


def _clear_grads(tensors: Iterable[Tensor]) -> None:
    for t in tensors:
        t.grad = None


def _run(fn: Candidate, inputs: Inputs, cotangents: list[Tensor], backward: bool) -> list[Tensor]:
    """One call, plus one backward with ``cotangents``. Time it with cotangents already in the
    outputs' dtypes (:func:`_cast`): a cast here would be timed and counted as memory."""
    outs = _outputs(inputs.call(fn))
    if backward:
        _backward(outs, cotangents)
    return outs


def _backward(outs: list[Tensor], cotangents: list[Tensor]) -> None:
    """One backward from the outputs that require grad, each with its cotangent in its dtype."""
    pairs = [(o, c.to(o.dtype)) for o, c in zip(outs, cotangents) if o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [c for _, c in pairs])


def _first_call(fn: Candidate, inputs: Inputs, cotangents: list[Tensor] | None,
                device: torch.device) -> tuple[list[Tensor], tuple[float, float]]:
    """The untimed first call, forward and backward (with ``cotangents``; ones when None): its
    outputs, and the seconds its forward and its forward + backward took (they size the
    measurement blocks when there is no warm-up)."""
    _sync(device)
    start = time.perf_counter()
    outs = _outputs(inputs.call(fn))
    _sync(device)
    forward = time.perf_counter() - start
    _backward(outs, [torch.ones_like(o) for o in outs] if cotangents is None else cotangents)
    _sync(device)
    return outs, (forward, time.perf_counter() - start)


def _block_calls(block_s: float, seconds: float) -> int:
    """Back-to-back calls of ``seconds`` each that last ``block_s`` (at least 1, at most _MAX_CALLS)."""
    return max(1, min(_MAX_CALLS, math.ceil(block_s / max(seconds, 1e-9))))


def _cast(cotangents: list[Tensor] | None, outs: list[Tensor], made: dict) -> list[Tensor]:
    """Cotangents in the dtypes of a candidate's outputs (ones when None), made outside the timing;
    ``made`` keeps one set per (shapes, dtypes) so that candidates share them."""
    key = tuple((tuple(o.shape), o.dtype) for o in outs)
    if key not in made:
        made[key] = ([torch.ones_like(o) for o in outs] if cotangents is None
                     else [c.to(o.dtype) for o, c in zip(outs, cotangents)])
    return made[key]


_SETTLED = 0.10  # warm-up ends when no per-call time moved by more than this between two rounds
_WARMUP_EXTRA, _WARMUP_EXTRA_S = 10, 10.0  # at most this many rounds / seconds beyond the requested warm-up
_MAX_CALLS = 10_000


def _measure(fn: Candidate, inputs: Inputs, cotangents: list[Tensor], backward: bool, diffs: list[Tensor],
             device: torch.device, calls: int) -> float:
    """Seconds per call of ``calls`` back-to-back calls (one pass: forward, or forward+backward)."""
    _clear_grads(diffs)
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        _run(fn, inputs, cotangents, backward)
        if backward:
            _clear_grads(diffs)  # no gradient accumulation inside the block
    _sync(device)
    return (time.perf_counter() - start) / calls


def _rel_err(got: Tensor, want: Tensor) -> float:
    """``max |got - want| / max |want|`` over the finite entries; inf for another shape or a
    non-finite entry of ``got`` where ``want`` holds another value (NaN where it is NaN, or the
    same infinity, agree)."""
    if got.shape != want.shape:
        return float("inf")
    want, got = want.detach().double(), got.detach().double().to(want.device)
    finite = want.isfinite() & got.isfinite()
    agree = finite | (got == want) | (got.isnan() & want.isnan())
    if not bool(agree.all()):
        return float("inf")
    diff = (got - want)[finite].abs().max().item() if bool(finite.any()) else 0.0
    scale = want[finite].abs().max().item() if bool(finite.any()) else 0.0
    return diff / scale if scale > 0 else diff


def _to_dtype(fn: Candidate, inputs: Inputs, dtype: torch.dtype) -> tuple[Candidate, Inputs]:
    def cast(t: Tensor) -> Tensor:
        if not isinstance(t, Tensor) or not t.is_floating_point():
            return t
        return t.detach().to(dtype).requires_grad_(t.requires_grad)

    fn2 = copy.deepcopy(fn).to(dtype) if isinstance(fn, nn.Module) else fn
    return fn2, inputs.map(cast)


def _peak_memory(fn: Candidate, inputs: Inputs, cotangents: list[Tensor], device: torch.device) -> int | None:
    """Peak bytes allocated above the starting level during one forward+backward call (:func:`peak_bytes`)."""
    _clear_grads(_differentiables(fn, inputs).values())
    return peak_bytes(lambda: _run(fn, inputs, cotangents, True), device)


def peak_bytes(call: Callable[[], Any], device: torch.device) -> int | None:
    """Peak bytes allocated above the starting level while ``call()`` runs on ``device`` (the
    engine's buffer pool is emptied first, so buffers it would reuse count as allocations): CUDA's
    peak counter, or on CPU the torch profiler's allocation records in time order; None elsewhere."""
    from .._core.pool import empty_cache

    gc.collect()
    empty_cache()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        call()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    if device.type != "cpu":
        return None
    # Kineto prints "USDT: ... profiler_start / profiler_stop" on stderr at every profile unless its
    # log level, read once when the profiler first starts in the process, is above those lines'
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    # the raw allocation records (name "[memory]", signed nbytes) rather than prof.events(), whose
    # Python event tree takes minutes for the ~10^6 ops of a per-column-view candidate
    raw = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if raw is not None:
        deltas = sorted((e.start_ns(), e.nbytes()) for e in raw.events() if e.name() == "[memory]")
    else:  # pragma: no cover - older/newer torch without the raw results
        deltas = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events())
    current = peak = 0
    for _, nbytes in deltas:
        current += nbytes
        peak = max(peak, current)
    return peak


def compare(
    candidates: Mapping[str, Candidate],
    make_inputs: Callable[[], Mapping[str, Tensor] | tuple | list],
    *,
    reference: str | Candidate | None = None,
    reference_dtype: torch.dtype | None = torch.float64,
    repeats: int = 5,
    warmup: int = 1,
    block_s: float = 0.02,
    cliff_threshold: float = 5.0,
    rtol: float | None = None,
    memory: bool = True,
    check: bool = True,
    workload: str = "custom",
    anchor: str | None = None,
    expected: Mapping[str, Iterable[str]] | None = None,
    progress: Callable[[str], None] | None = None,
    seed: int = 0,
) -> Report:
    """Check that candidates agree in value and gradient, then time forward and forward+backward.

    Args:
        candidates: name -> callable taking the inputs (as ``make_inputs`` gives them) and returning a tensor
            or a tuple of tensors. An ``nn.Module`` candidate also has its parameters' gradients
            compared, by parameter name, so give candidates the same weights; the tensors a plain
            callable holds in its closure are compared with the reference's by shape (module
            docstring).
        make_inputs: returns the inputs of every call: a dict name -> tensor (keyword arguments) or a
            tuple/list (positional arguments; named by position); tensors with ``requires_grad`` get their gradients
            compared. Called once; every candidate sees the same tensors.
        reference: the oracle: None (the first candidate), a candidate's name, or another
            callable; evaluated in ``reference_dtype`` (float64; None keeps the inputs' dtype).
        repeats: timed measurements per candidate and pass (interleaved across candidates, the order
            rotated every run); each is the mean time per call of enough back-to-back calls to last
            ``block_s`` seconds (one call for candidates slower than that).
        warmup: untimed rounds first (0: none; the blocks are then sized from each candidate's
            untimed first call, the check's or the one that finds its outputs' shapes); from 1 on,
            more follow until no candidate's time per call moved by more than 10% between two
            rounds (at most 10 more rounds or 10 s), each re-sizing the blocks. The report's
            ``warmup`` is the number of rounds run.
        block_s: the shortest duration of one measurement, in seconds.
        cliff_threshold: flag ``cliff`` when (forward+backward) / forward exceeds it.
        rtol: max relative error (``max |got - ref| / max |ref|``) before a mismatch flag; default
            1e-3 for float32, 1e-2 for float16, 8e-2 for bfloat16 (8x float16's: its precision is
            8x coarser), 1e-7 for float64.
        memory: measure peak memory of one forward+backward (CPU: the torch profiler's
            allocation records in time order; CUDA: max_memory_allocated). A candidate with the
            attribute ``bench_memory = False`` is left out (reported as "-"): recording every
            op of a per-view candidate with ~10^6 ops takes tens of GiB on CPU.
        check: compare values and gradients (False: time only; the report's ``checked`` is False
            and its table says "not checked" instead of a flag).
        reference_dtype: the dtype the reference runs in (its module copied, its inputs cast);
            None: the inputs' own.
        workload: the name the report carries.
        anchor: the candidate the report's ratios are against (None: the first); the report keeps it.
        expected: candidate name -> the flag kinds it is built to get (a speed anchor that computes
            another function); the report keeps them (:meth:`Report.unexpected`).
        progress: called with a short message before each step (for a progress bar).
        seed: ``torch.manual_seed`` before ``make_inputs``, and the seed of the random cotangents
            (from a float64 normal, cast to each output's dtype).

    Returns:
        A :class:`Report`.

    Raises:
        TypeError: ``make_inputs`` returned something other than a dict, tuple or list.
        ValueError: no candidates, ``repeats`` < 1, ``warmup`` < 0, or a reference or anchor name that
            is not a candidate.
    """
    if not candidates:
        raise ValueError("candidates: expected at least one name -> callable, got none")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:  # (0: no times, NaN medians)
        raise ValueError(f"repeats: expected an int >= 1, got {repeats!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:  # (as --warmup refuses it)
        raise ValueError(f"warmup: expected an int >= 0, got {warmup!r}")
    say = progress or (lambda msg: None)
    if isinstance(reference, str) and reference not in candidates:
        raise ValueError(f"reference: expected a candidate name {list(candidates)}, got {reference!r}")
    if anchor is not None and anchor not in candidates:
        raise ValueError(f"anchor: expected a candidate name {list(candidates)}, got {anchor!r}")
    torch.manual_seed(seed)
    inputs = Inputs.of(make_inputs())
    tensors = [v for v in inputs.named().values() if isinstance(v, Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    floats = [t for t in tensors if t.is_floating_point()]
    dtype = floats[0].dtype if floats else torch.float32
    if rtol is None:
        rtol = {torch.float64: 1e-7, torch.float32: 1e-3, torch.bfloat16: 8e-2}.get(dtype, 1e-2)
    results = {name: CandidateResult(name) for name in candidates}

    cotangents = None
    cast: dict[str, list[Tensor]] = {}  # name -> cotangents in that candidate's output dtypes
    # name -> the leaves its backward accumulates into (a closure's own parameters too): cleared
    # between timed calls as the inputs' and a module's are, so no candidate times accumulation
    leaves: dict[str, list[Tensor]] = {}
    first: dict[str, tuple[float, float]] = {}  # name -> seconds of the untimed first call: forward, forward + backward
    made: dict = {}
    ref_name = reference if isinstance(reference, str) else ("custom" if reference is not None else next(iter(candidates)))
    if check:
        say(f"reference {ref_name}")
        ref_fn = candidates[reference] if isinstance(reference, str) else (reference or next(iter(candidates.values())))
        ref_fn, ref_inputs = _to_dtype(ref_fn, inputs, reference_dtype) if reference_dtype else (ref_fn, inputs)
        ref_outs = _outputs(ref_inputs.call(ref_fn))
        g = torch.Generator().manual_seed(seed)
        cotangents = [torch.randn(o.shape, generator=g, dtype=o.dtype).to(o.device) for o in ref_outs]
        ref_diffs = _differentiables(ref_fn, ref_inputs)
        ref_closure = _closure_tensors(ref_outs, [*ref_diffs.values(), *ref_inputs.named().values()])
        ref_diffs.update(_closure_names(ref_closure, ref_closure))
        _clear_grads(ref_diffs.values())
        _backward(ref_outs, cotangents)  # (the cotangents are made in ref_outs' dtypes)
        ref_grads = {k: v.grad for k, v in ref_diffs.items()}
        _clear_grads([*ref_diffs.values(), *_graph_leaves(ref_outs)])  # (the gradients are kept in ref_grads)
        for name, fn in candidates.items():
            say(f"check {name}")
            res = results[name]
            diffs = _differentiables(fn, inputs)
            _clear_grads(diffs.values())
            outs, first[name] = _first_call(fn, inputs, cotangents, device)
            cast[name] = _cast(cotangents, outs, made)
            leaves[name] = _graph_leaves(outs)
            diffs.update(_closure_names(_closure_tensors(outs, [*diffs.values(), *inputs.named().values()]),
                                        ref_closure))
            if len(outs) != len(ref_outs):
                res.output_error = float("inf")
            else:
                res.output_error = max((_rel_err(o, r) for o, r in zip(outs, ref_outs)), default=0.0)
            if not res.output_error <= rtol:
                res.flags.append("value mismatch")
            _check_gradients(res, fn, diffs, ref_grads, rtol)
            _clear_grads([*diffs.values(), *leaves[name]])
        del ref_outs, ref_grads, ref_fn, ref_inputs

    for name, fn in candidates.items():
        if name not in cast:  # no check run: one untimed call gives the outputs' shapes, dtypes and leaves
            outs, first[name] = _first_call(fn, inputs, None, device)
            cast[name] = _cast(cotangents, outs, made)
            leaves[name] = _graph_leaves(outs)
            _clear_grads([*_differentiables(fn, inputs).values(), *leaves[name]])
            del outs
    names = list(candidates)
    calls = {name: results[name].calls for name in names}
    if warmup == 0:  # no warm-up to size the blocks from: the untimed first call's times size them
        for name in names:
            calls[name][:] = [_block_calls(block_s, t) for t in first[name]]
    passes = (False, True)  # forward, then forward + backward

    def measure_round(order: list[str], store: bool) -> dict[str, list[float]]:
        """One measurement of both passes of every candidate (order rotated by the caller)."""
        times = {}
        for name in order:
            fn = candidates[name]
            diffs = [*_differentiables(fn, inputs).values(), *leaves[name]]
            times[name] = [_measure(fn, inputs, cast[name], backward, diffs, device, calls[name][i])
                           for i, backward in enumerate(passes)]
            if store:
                results[name].forward_s.append(times[name][0])
                results[name].forward_backward_s.append(times[name][1])
        return times

    # warm-up: at least `warmup` rounds, then more (within _WARMUP_EXTRA rounds and _WARMUP_EXTRA_S seconds)
    # until every candidate's per-call times moved by at most _SETTLED between two rounds; each round
    # also re-sizes the measurement blocks from the times just taken
    previous, rounds, extra_start = None, 0, None
    while warmup > 0:
        say(f"warm-up {rounds + 1}")
        now = measure_round(names[rounds % len(names):] + names[:rounds % len(names)], False)
        rounds += 1
        for name in names:
            calls[name][:] = [_block_calls(block_s, t) for t in now[name]]
        settled = previous is not None and all(abs(now[n][i] / previous[n][i] - 1) <= _SETTLED
                                               for n in names for i in range(2))
        if rounds >= warmup:
            extra_start = extra_start or time.perf_counter()
            if settled or rounds >= warmup + _WARMUP_EXTRA or time.perf_counter() - extra_start > _WARMUP_EXTRA_S:
                break
        previous = now
    for rep in range(repeats):
        shift = rep % len(names)  # rotate the order every run: no candidate always follows the same one
        say(f"run {rep + 1}/{repeats}")
        measure_round(names[shift:] + names[:shift], True)

    for name, fn in candidates.items():
        res = results[name]
        if res.backward_ratio > cliff_threshold:
            res.flags.append("cliff")
        if memory and getattr(fn, "bench_memory", True):
            say(f"memory {name}")
            _clear_grads(leaves[name])
            res.peak_memory_bytes = _peak_memory(fn, inputs, cast[name], device)

    return Report(
        workload=workload,
        dtype=str(dtype).replace("torch.", ""),
        device=str(device),
        threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        cpu=cpu_name(),
        repeats=repeats,
        warmup=rounds,
        reference=(f"{ref_name} in {str(reference_dtype).replace('torch.', '') if reference_dtype else dtype}"
                   if check else "none (not checked)"),
        cliff_threshold=cliff_threshold,
        results=list(results.values()),
        checked=check,
        anchor=anchor,
        expected={name: list(kinds) for name, kinds in (expected or {}).items()},
    )
