"""The comparison harness flags planted wrong values, dropped gradients and cliffs; JSON; CLI."""

import json
import re

import pytest
import torch
from torch import nn

from fastlayers.bench import WORKLOADS, Report, compare
from fastlayers.cli import main


def _inputs():
    return {"x": torch.randn(4, 3, requires_grad=True), "y": torch.randn(4, 3, requires_grad=True)}


def good(x, y):
    return (x * y).tanh()


class _DropsGradient(torch.autograd.Function):
    """x * y whose backward returns None (or zeros) for y: the seed-000 Zygote bug, planted."""

    @staticmethod
    def forward(ctx, x, y, zeros):
        ctx.save_for_backward(x, y)
        ctx.zeros = zeros
        return x * y

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        return grad * y, (torch.zeros_like(y) if ctx.zeros else None), None


_CLOCK = [0.0]  # the harness's clock in test_flags_cliff: advanced by the candidates, not by time


class _ClockedPasses(torch.autograd.Function):
    """x.clone() whose forward takes 1 ms and backward 10 ms of the fake clock: a 10x cliff, with
    no timing of real work (a timing assertion would be flaky)."""

    @staticmethod
    def forward(ctx, x):
        _CLOCK[0] += 1e-3
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _CLOCK[0] += 1e-2
        return grad


def test_agreeing_candidates_are_not_flagged():
    # cliff_threshold=inf: tiny ops have backward/forward ratios set by overhead, not by the code
    rep = compare({"a": good, "b": lambda x, y: torch.tanh(y * x)}, _inputs, repeats=2, memory=False,
                  cliff_threshold=float("inf"))
    assert [r.flags for r in rep.results] == [[], []]
    assert rep["b"].output_error < 1e-6
    assert set(rep["b"].grad_errors) == {"input:x", "input:y"}
    assert len(rep["a"].forward_s) == 2 and len(rep["a"].forward_backward_s) == 2


def test_flags_wrong_value():
    rep = compare({"ref": good, "wrong": lambda x, y: good(x, y) + 1e-2}, _inputs, repeats=1, memory=False,
                  cliff_threshold=float("inf"))
    assert "value mismatch" in rep["wrong"].flags
    assert rep["ref"].flags == []


@pytest.mark.parametrize("zeros", [False, True])
def test_flags_dropped_gradient(zeros):
    cands = {"ref": lambda x, y: (x * y).tanh(), "dropped": lambda x, y: _DropsGradient.apply(x, y, zeros).tanh()}
    rep = compare(cands, _inputs, repeats=1, memory=False)
    assert "missing gradient: input:y" in rep["dropped"].flags
    assert "value mismatch" not in rep["dropped"].flags
    assert not any("input:x" in f for f in rep["dropped"].flags)


def test_flags_gradient_mismatch_of_a_parameter():
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    other = nn.Linear(3, 2)
    other.load_state_dict(lin.state_dict())

    class Scaled(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x, y):
            out = self.m(x)
            return out + (0.5 * self.m.bias - 0.5 * self.m.bias.detach())  # same value, wrong bias gradient

    class Plain(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x, y):
            return self.m(x)

    rep = compare({"ref": Plain(lin), "bad": Scaled(other)}, _inputs, repeats=1, memory=False)
    assert "gradient mismatch: param:m.bias" in rep["bad"].flags
    assert "value mismatch" not in rep["bad"].flags


def test_flags_cliff(monkeypatch):
    """A backward 10x its forward is flagged at the threshold 5, one whose passes cost the same is
    not (the harness's clock is the candidates' fake one: deterministic)."""
    from fastlayers.bench import _harness

    monkeypatch.setattr(_harness, "time", type("FakeTime", (), {"perf_counter": staticmethod(lambda: _CLOCK[0])}))

    def even(x, y):
        _CLOCK[0] += 1e-3
        return x * y

    rep = compare({"ref": even, "cliff": lambda x, y: _ClockedPasses.apply(x) * y}, _inputs, repeats=2, memory=False,
                  cliff_threshold=5)
    assert "cliff" in rep["cliff"].flags and "cliff" not in rep["ref"].flags
    assert rep["cliff"].backward_ratio == pytest.approx(11.0) and rep["ref"].backward_ratio == pytest.approx(1.0)


def test_json_round_trip_and_memory():
    rep = compare({"a": good, "b": good}, _inputs, repeats=1, memory=True)
    again = Report.from_json(rep.to_json())
    assert again == rep
    assert all(r.peak_memory_bytes is not None and r.peak_memory_bytes >= 0 for r in rep.results)
    assert "a" in rep.render()


def _transient(x, y):
    # a 4 MB temporary that is freed before the call returns: the peak must still see it
    return x * y * torch.ones(1_000_000, dtype=x.dtype).sum()


def test_peak_memory_sees_transients_and_opt_out():
    def skipped(x, y):
        return _transient(x, y)

    skipped.bench_memory = False
    rep = compare({"t": _transient, "skipped": skipped}, _inputs, repeats=1, memory=True,
                  cliff_threshold=float("inf"))
    assert rep["t"].peak_memory_bytes >= 4_000_000
    assert rep["skipped"].peak_memory_bytes is None
    assert rep["skipped"].flags == [] and rep["skipped"].output_error < 1e-6


class _RecordGrad(torch.autograd.Function):
    """2 * x that records the dtype and storage of every cotangent its backward receives."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, grad):
        _RecordGrad.seen.append((grad.dtype, grad.data_ptr()))
        return 2 * grad


@pytest.mark.parametrize("check", [True, False])
def test_cotangents_are_cast_once_outside_the_timed_calls(check):
    # the reference runs in float64; a float32 candidate must get float32 cotangents made before
    # the timing (one tensor reused), not a cast inside every timed and memory-measured call
    n = 1_000_000

    def make():
        return {"x": torch.randn(n, requires_grad=True)}

    _RecordGrad.seen.clear()
    rep = compare({"double": _RecordGrad.apply}, make, repeats=3, warmup=1, memory=True, check=check)
    timed = _RecordGrad.seen[-5:]  # 1 warm-up + 3 timed + 1 memory run, all after the check
    assert {d for d, _ in timed} == {torch.float32}
    assert len({p for _, p in timed}) == 1
    # output (4 MB) + gradient of x (4 MB); a cast cotangent would add another 4 MB
    assert 8_000_000 <= rep["double"].peak_memory_bytes < 11_000_000


@pytest.mark.parametrize("which", [0, 1])
def test_a_nan_output_is_a_mismatch(which):
    """NaN compares False with the tolerance and Python's max drops it: it once passed as "ok"."""
    def nan_in(x, y):
        outs = [good(x, y), good(x, y) * 2]
        outs[which] = outs[which] * torch.tensor([float("nan")] + [1.0] * (outs[which].size(1) - 1))
        return tuple(outs)

    rep = compare({"ref": lambda x, y: (good(x, y), good(x, y) * 2), "nan": nan_in}, _inputs, repeats=1, warmup=0,
                  memory=False)
    assert rep["nan"].output_error == float("inf") and "value mismatch" in rep["nan"].flags
    assert rep["ref"].flags == [] or rep["ref"].flags == ["cliff"]


def test_a_nan_gradient_is_a_mismatch_not_a_missing_one():
    class NanGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * float("nan")

    rep = compare({"ref": good, "nan": lambda x, y: good(NanGrad.apply(x), y)}, _inputs, repeats=1, warmup=0,
                  memory=False)
    assert "gradient mismatch: input:x" in rep["nan"].flags
    assert not any(f.startswith("missing") for f in rep["nan"].flags)


def test_parameters_a_function_reference_cannot_name_are_flagged():
    """A module candidate against a plain-function reference: its parameters have no counterpart,
    so a dropped one is "missing" and the others "unchecked" (they once went unreported)."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)

    class DetachesWeight(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x, y):
            return torch.nn.functional.linear(x, self.lin.weight.detach(), self.lin.bias) + y

    rep = compare({"fn": lambda x, y: torch.nn.functional.linear(x, lin.weight, lin.bias) + y,
                   "module": DetachesWeight()}, _inputs, repeats=1, warmup=0, memory=False, reference_dtype=None)
    assert "missing gradient: param:lin.weight" in rep["module"].flags
    assert "unchecked gradient: param:lin.bias" in rep["module"].flags
    assert rep["module"].failures() and not rep["fn"].failures()


def test_a_closures_parameters_are_cleared_between_timed_calls():
    """The timed calls of a closure over a module start without accumulated gradients, as a
    module candidate's do (a closure once timed accumulation into its parameters' .grad)."""
    lin = nn.Linear(3, 3)
    seen = []

    def closure(x, y):
        seen.append(lin.weight.grad is None)
        return lin(x) + y

    compare({"closure": closure}, _inputs, repeats=3, warmup=1, memory=False, block_s=0.0, reference_dtype=None)
    assert len(seen) > 4 and all(seen)


def test_unchecked_comparisons_say_so():
    rep = compare({"a": torch.tanh, "b (wrong)": torch.sigmoid}, lambda: {"x": torch.randn(4, requires_grad=True)},
                  repeats=1, warmup=0, memory=False, check=False)
    assert rep.checked is False and rep.reference == "none (not checked)"
    assert "| b (wrong) |" in rep.markdown() and rep.markdown().count("not checked |") == 2
    assert "values and gradients not checked" in rep.markdown()
    assert Report.from_json(rep.to_json()).checked is False


def test_bfloat16_tolerance_is_coarser_than_float16s():
    """Default rtol by dtype: bf16's precision is 8x coarser than fp16's (torch's own LSTM once
    failed its check at bf16)."""
    def inputs(dtype):
        return lambda: {"x": torch.randn(64, dtype=dtype, requires_grad=True)}

    def rounded_tanh(x):  # an error of ~3e-2 relative: within bf16's budget, outside fp16's
        return torch.tanh(x) * (1 + 3e-2)

    bf16 = compare({"a": torch.tanh, "b": rounded_tanh}, inputs(torch.bfloat16), repeats=1, warmup=0, memory=False)
    fp16 = compare({"a": torch.tanh, "b": rounded_tanh}, inputs(torch.float16), repeats=1, warmup=0, memory=False)
    assert not bf16["b"].failures() and "value mismatch" in fp16["b"].flags


def test_bad_reference_name():
    with pytest.raises(ValueError, match=r"reference: expected a candidate name \['a'\], got 'nope'"):
        compare({"a": good}, _inputs, reference="nope", repeats=1)


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_cli_small_runs_every_workload(workload, tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    assert main(["bench", workload, "--size", "small", "--repeats", "1", "--json", str(out_json),
                 "--plot", str(out_png)]) == 0
    data = json.loads(out_json.read_text())
    assert data["workload"].startswith(workload.split("-")[0])
    made = WORKLOADS[workload]("small")
    assert data["anchor"] == made.anchor and data["expected"] == {k: list(v) for k, v in made.expected.items()}
    assert len(data["results"]) >= 3
    for r in data["results"]:
        assert len(r["forward_s"]) == 1 and r["output_error"] is not None
        correctness = [f for f in r["flags"] if f != "cliff"]  # cliff depends on timing: not asserted
        if "ignores lengths" in r["name"]:
            assert "value mismatch" in correctness, r  # padded without lengths computes another function
        else:
            assert correctness == [], (r["name"], r["flags"])
    assert out_png.stat().st_size > 1000
    assert "reference:" in capsys.readouterr().out


@pytest.mark.parametrize("extra,message", [
    (["--repeats", "0"], r"--repeats: expected >= 1, got 0"),
    (["--warmup", "-1"], r"--warmup: expected >= 0, got -1"),
    (["--size", "seed-large"], r"--size seed-large: only the local2d workload has it, got attention"),
    (["--device", "tpu"], r"--device tpu: expected cpu, cuda or cuda:N, got 'tpu'"),
    (["--device", "meta"], r"--device meta: expected cpu, cuda or cuda:N, got 'meta'"),
    (["--device", "cuda:99"], r"--device cuda:99: not usable here with torch \S+ \(\w+: .*"),
    (["--json", "{tmp}/no/such/folder/r.json"], r"--json \S+/no/such/folder/r.json: cannot write there \(no writable "
                                                r"folder '\S+/no/such/folder'\)"),
    (["--json", "{tmp}"], r"--json \S+: is a folder; expected a file name"),
    (["--plot", "{tmp}/r.txt"], r"--plot \S+/r.txt: expected a file name ending in one of the formats matplotlib "
                                r"writes without other programs \(.*\.png.*\), got '.txt'"),
    (["--plot", "{tmp}/r.pgf"], r"--plot \S+/r.pgf: expected .* \(\.png, \.pdf, \.svg, .*\), got '.pgf'"),  # (LaTeX)
    (["--plot", "{tmp}/r.ps"], r"--plot \S+/r.ps: expected .*, got '.ps'"),
    (["--json", "{tmp}/earlier.json"], r"--json \S+/earlier.json: exists; pass --overwrite to replace it, or name "
                                       r"another file"),
    (["--plot", "{tmp}/earlier.json"], r"--plot \S+/earlier.json: exists; pass --overwrite to replace it, or name "
                                       r"another file"),
    (["--json", "{tmp}/r.png", "--plot", "{tmp}/./r.png"], r"--json \S+/r.png, --plot \S+/r.png: the same file \(the "
                                                          r"plot would replace the report\); name two files"),
])
def test_cli_refuses_bad_settings_before_measuring(extra, message, tmp_path, monkeypatch):
    """A setting the run would fail on (a device torch cannot use, a report file that cannot be
    written) is one line before the measurement, not a traceback at its start or after it."""
    from fastlayers.bench import _cli

    def measured(*args, **kwargs):
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr(_cli, "compare", measured)
    (tmp_path / "earlier.json").write_text("the user's earlier report")
    with pytest.raises(SystemExit) as got:
        main(["bench", "attention", "--size", "small", *[a.format(tmp=tmp_path) for a in extra]])
    assert re.fullmatch("fastlayers bench: " + message, str(got.value)), str(got.value)
    assert (tmp_path / "earlier.json").read_text() == "the user's earlier report"


def test_cli_plot_without_a_suffix_needs_matplotlib_before_measuring(tmp_path, monkeypatch):
    """``--plot chart`` (a PNG) without matplotlib: refused before the measurement, as ``chart.png``."""
    import sys

    from fastlayers.bench import _cli

    def measured(*args, **kwargs):
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr(_cli, "compare", measured)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delitem(sys.modules, "matplotlib.figure", raising=False)
    with pytest.raises(SystemExit, match="needs matplotlib"):
        main(["bench", "attention", "--size", "small", "--plot", str(tmp_path / "chart")])


def test_cli_exits_non_zero_when_a_candidate_fails_its_check(monkeypatch, capsys):
    """A candidate whose gradient is dropped fails ``fastlayers bench`` (exit status 1, the
    candidate named); the flags a workload expects (its padded speed anchors) do not."""
    from fastlayers.bench import _cli, _workloads

    real = _workloads.attention

    def broken(*args, **kwargs):
        w = real(*args, **kwargs)
        name = "fastlayers.attention_pool"
        fn = w.candidates[name]
        w.candidates[name] = lambda **kw: [o.detach() for o in fn(**kw)]  # no gradient at all
        return w

    monkeypatch.setitem(_cli.WORKLOADS, "attention", broken)
    assert main(["bench", "attention", "--size", "small", "--repeats", "1", "--warmup", "0", "--no-memory"]) == 1
    out = capsys.readouterr()
    assert re.search(r"check failed .*fastlayers\.attention_pool: missing gradient", out.err)
    assert "check failed" not in out.out and "fastlayers.attention_pool" in out.out  # (the table)
    assert main(["bench", "blstm", "--size", "small", "--repeats", "1", "--warmup", "0", "--no-memory"]) == 0


@pytest.mark.parametrize("overwrite", [True, False])
@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_cli_report_files_are_written_whole_or_not_at_all(option, overwrite, tmp_path, monkeypatch, capsys):
    """A report whose writing fails midway (a full disk) leaves the file the user had there as it
    was, and no stray file beside it; it is one line naming the file and the error, exit status 1,
    after the table (so the measurement is not lost), not a traceback."""
    from fastlayers.bench import _cli

    out = tmp_path / ("r.json" if option == "--json" else "r.png")
    if overwrite:
        out.write_text("the user's earlier report")
    real = _cli.write_atomic

    def write_then_fail(path, write):
        def broken(f):
            write(f)
            raise OSError(28, "No space left on device")
        real(path, broken)

    monkeypatch.setattr(_cli, "write_atomic", write_then_fail)
    assert main(["bench", "attention", "--size", "small", "--repeats", "1", "--warmup", "0", "--no-memory", option,
                 str(out), *(["--overwrite"] if overwrite else [])]) == 1
    got = capsys.readouterr()
    assert got.err.strip() == f"fastlayers bench: {option} {out}: not written (OSError: No space left on device)"
    assert "fastlayers.attention_pool" in got.out  # the table
    assert [p.name for p in tmp_path.iterdir()] == (["r.json" if option == "--json" else "r.png"] if overwrite else [])
    if overwrite:
        assert out.read_text() == "the user's earlier report"


@pytest.mark.parametrize("links", [True, False], ids=["hard links", "no hard links"])
@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_cli_a_file_made_during_the_run_is_not_replaced(option, links, tmp_path, monkeypatch, capsys):
    """Without --overwrite, a report file that someone makes while the benchmark runs (after the
    check before measuring) is left as it is: one line names it and where the report went instead
    (also on a file system without hard links, where the report was deleted)."""
    from fastlayers.bench import _cli

    if not links:
        def no_links(src, dst):
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(_cli.os, "link", no_links)

    out = tmp_path / ("r.json" if option == "--json" else "r.svg")
    real = _cli.compare

    def measured_meanwhile(*args, **kwargs):
        report = real(*args, **kwargs)
        out.write_text("someone else's file")
        return report

    monkeypatch.setattr(_cli, "compare", measured_meanwhile)
    assert main(["bench", "attention", "--size", "small", "--repeats", "1", "--warmup", "0", "--no-memory", option,
                 str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert out.read_text() == "someone else's file"
    (left,) = [p for p in tmp_path.iterdir() if p != out]
    assert err == (f"fastlayers bench: {option} {out}: made by someone else during the run, so not replaced (pass "
                   f"--overwrite to replace it); written to {left} instead")
    if option == "--json":
        assert Report.from_json(left.read_text()).workload.startswith("attention")
    else:
        assert left.read_bytes().startswith(b"<?xml")


def test_cli_list(capsys):
    """Every workload with its whole description (local2d's was cut after its first line)."""
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for name in WORKLOADS:
        assert name in out
    assert ("local2d    Seed 003: x (32, 4, 256, 256), 2 output channels, 1x1 unshared kernel; W and b require grad "
            "(size=\"seed-large\": the seed's example batch of 1024, x 1 GiB in fp32).\n") in out


def test_cli_help_says_the_defaults(capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for default in ("(default: seed)", "(default: float32)", "(default: cpu)", "(default: 5)", "(default: 1)"):
        assert default in out
    assert "minutes per workload" in out


def test_positional_inputs_and_function_apply_candidates():
    """make_inputs may return a tuple (positional arguments, named by position); a candidate may then be an
    autograd.Function's apply, which takes no keywords."""
    class Mul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(x, y)
            return x * y

        @staticmethod
        def backward(ctx, grad):
            x, y = ctx.saved_tensors
            return grad * y, grad * x

    def make():
        return torch.randn(4, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True)

    rep = compare({"torch": torch.mul, "function": Mul.apply}, make, repeats=1, memory=False,
                  cliff_threshold=float("inf"))
    assert [r.flags for r in rep.results] == [[], []]
    assert set(rep["function"].grad_errors) == {"input:0", "input:1"}
    rep = compare({"a": torch.mul}, lambda: [torch.ones(2, requires_grad=True), torch.ones(2)], repeats=1,
                  memory=False, cliff_threshold=float("inf"))
    assert set(rep["a"].grad_errors) == {"input:0"}


def test_make_inputs_of_another_type_is_a_type_error():
    with pytest.raises(TypeError, match=r"make_inputs: expected it to return a dict \(keyword arguments\) or a "
                                        r"tuple/list \(positional arguments\) of tensors, got Tensor"):
        compare({"a": torch.tanh}, lambda: torch.ones(2), repeats=1, memory=False)


@pytest.mark.subprocess
def test_memory_measurement_prints_nothing_from_the_profiler():
    import subprocess
    import sys

    code = ("import torch\nfrom fastlayers.bench import compare\n"
            "compare({'a': torch.tanh}, lambda: {'x': torch.ones(8, requires_grad=True)}, repeats=1)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""
    proc = subprocess.run([sys.executable, "-m", "fastlayers.cli", "bench", "attention", "--size", "small",
                           "--repeats", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "USDT" not in proc.stdout + proc.stderr and "profiler_start" not in proc.stderr


class _FakeClock:
    """The harness's clock (its ``time`` module) made of a counter the test advances: timings
    that do not depend on this machine's speed."""

    now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def __getattr__(self, name):
        import time

        return getattr(time, name)


def _fake_clock(monkeypatch) -> _FakeClock:
    from fastlayers.bench import _harness

    clock = _FakeClock()
    monkeypatch.setattr(_harness, "time", clock)
    return clock


def test_short_candidates_are_timed_over_blocks_of_calls(monkeypatch):
    """A sub-millisecond candidate is timed over back-to-back calls (one measurement lasts about
    block_s), the warm-up runs at least the requested rounds, and the report says how many ran.
    The harness's clock is a fake one that a call advances by 2**-12 s (no assumption on this
    machine's speed; powers of two, so the sums are exact): blocks of 2**-7 s are 32 calls."""
    counts = {"n": 0}
    clock = _fake_clock(monkeypatch)

    def tiny(x):
        counts["n"] += 1
        clock.now += 2.0 ** -12
        return x * 2

    rep = compare({"tiny": tiny}, lambda: {"x": torch.ones(4, requires_grad=True)}, repeats=3, warmup=2,
                  block_s=2.0 ** -7, memory=False, check=False)
    res = rep["tiny"]
    assert res.calls == [32, 32] and rep.warmup >= 2
    assert res.forward_s == res.forward_backward_s == [2.0 ** -12] * 3
    assert len(res.forward_s) == len(res.forward_backward_s) == 3
    # every timed measurement ran res.calls calls per pass (plus the untimed shape call and warm-up)
    assert counts["n"] >= 3 * sum(res.calls) + 1
    assert json.loads(rep.to_json())["results"][0]["calls"] == res.calls


def test_no_warmup_means_no_untimed_rounds():
    """warmup=0: the candidate runs its untimed first call, then the timed blocks only."""
    seen = []

    def tanh(x):
        seen.append(1)
        return torch.tanh(x)

    rep = compare({"a": tanh}, lambda: {"x": torch.ones(4, requires_grad=True)}, repeats=2, warmup=0,
                  memory=False, check=False)
    assert rep.warmup == 0 and len(seen) == 1 + 2 * sum(rep["a"].calls)


@pytest.mark.parametrize("check", [True, False])
def test_without_warmup_blocks_are_sized_from_the_first_call(check, monkeypatch):
    """warmup=0 still times a sub-millisecond candidate over blocks that last block_s (they were
    single calls: the blocks were sized in the warm-up only). A fake clock that a forward advances
    by 2**-12 s and a backward by 2**-11 s: blocks of 2**-7 s are 32 and 11 calls."""
    clock = _fake_clock(monkeypatch)

    class Tick(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            clock.now += 2.0 ** -12
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            clock.now += 2.0 ** -11
            return grad * 2

    rep = compare({"tiny": Tick.apply}, lambda: {"x": torch.ones(4, requires_grad=True)}, repeats=2, warmup=0,
                  block_s=2.0 ** -7, memory=False, check=check, reference_dtype=None)
    res = rep["tiny"]
    assert rep.warmup == 0 and res.calls == [32, 11]
    assert res.forward_s == [2.0 ** -12] * 2 and res.forward_backward_s == [3 * 2.0 ** -12] * 2


def test_json_keeps_the_anchor_and_prints_the_same_ratios():
    """A report read back from JSON divides by the anchor it was measured against (it once fell
    back to the first candidate), and keeps the flags its workload expects; JSON written before
    the fields existed still loads."""
    rep = compare({"a": good, "b": lambda x, y: good(x, y) + 1e-2, "anchor": good}, _inputs, repeats=1, warmup=0,
                  memory=False, anchor="anchor", expected={"b": ("value mismatch",)},
                  cliff_threshold=float("inf"))  # (a cliff flag depends on this machine's timings)
    rep["anchor"].forward_s, rep["anchor"].forward_backward_s = [2.0], [4.0]  # ratios 0.00 if the anchor is kept
    again = Report.from_json(rep.to_json())
    assert again == rep and again.markdown() == rep.markdown()
    assert again.anchor == "anchor" and "value mismatch" in again["b"].flags and again.unexpected(again["b"]) == []
    anchor_row = [line for line in again.markdown().splitlines() if line.startswith("| anchor |")]
    assert anchor_row[0].split(" | ")[4:6] == ["1.00", "1.00"]
    old = json.loads(rep.to_json())
    del old["anchor"], old["expected"]
    assert Report.from_json(json.dumps(old)).anchor is None
    with pytest.raises(ValueError, match=r"anchor: expected a candidate name \['a'\], got 'nope'"):
        compare({"a": good}, _inputs, anchor="nope", repeats=1)


def test_json_is_strict_and_round_trips_non_finite_numbers():
    """A missing gradient's error (inf), an unbounded cliff threshold and a NaN are written as
    strict JSON (no Infinity / NaN tokens, which other readers refuse) and read back as they were."""
    cands = {"ref": lambda x, y: (x * y).tanh(), "dropped": lambda x, y: _DropsGradient.apply(x, y, False).tanh()}
    rep = compare(cands, _inputs, repeats=1, warmup=0, memory=False, cliff_threshold=float("inf"))
    assert rep["dropped"].grad_errors["input:y"] == float("inf")
    rep["ref"].forward_s = [float("nan")]
    text = rep.to_json()

    def refuse(token):
        raise AssertionError(f"non-standard JSON: {token}")

    data = json.loads(text, parse_constant=refuse)
    assert data["cliff_threshold"] == "inf" and data["results"][1]["grad_errors"]["input:y"] == "inf"
    again = Report.from_json(text)
    assert again.cliff_threshold == float("inf") and again["dropped"].grad_errors["input:y"] == float("inf")
    assert again["ref"].forward_s[0] != again["ref"].forward_s[0]  # NaN
    again["ref"].forward_s = rep["ref"].forward_s = [1.0]
    assert again == rep
    old = text.replace('"inf"', "Infinity")  # (what to_json wrote before)
    assert Report.from_json(old)["dropped"].grad_errors["input:y"] == float("inf")


def test_a_closures_gradients_are_checked():
    """The tensors plain-function candidates hold in closures are compared with the reference's by
    shape: a detached one is flagged (it once passed unnoticed), a copy of the reference's passes,
    a wrong gradient is a mismatch."""
    torch.manual_seed(0)
    w1 = torch.randn(4, 3, requires_grad=True)
    w2, w3, w4 = (w1.detach().clone().requires_grad_(True) for _ in range(3))
    rep = compare({"ref": lambda x, y: x * w1 + y,
                   "detached": lambda x, y: x * w2.detach() + y,
                   "copy": lambda x, y: y + w3 * x,
                   "wrong": lambda x, y: x * w4 + y + (0.5 * w4 - 0.5 * w4.detach())},
                  _inputs, repeats=1, warmup=0, memory=False, cliff_threshold=float("inf"))
    assert rep["detached"].flags == ["unchecked gradient: closure:0[4x3]"]
    assert rep["copy"].flags == [] and rep["copy"].grad_errors["closure:0[4x3]"] < 1e-6
    assert rep["wrong"].flags == ["gradient mismatch: closure:0[4x3]"]
    assert rep["ref"].flags == []
    # a closure tensor the reference has no counterpart of, receiving a gradient, is flagged too
    rep = compare({"ref": lambda x, y: x * y, "extra": lambda x, y: x * y + 0 * w1}, _inputs, repeats=1, warmup=0,
                  memory=False, cliff_threshold=float("inf"))
    assert rep["extra"].flags == [] and rep["extra"].failures() == []  # (an all-zero gradient: no parameter)
    rep = compare({"ref": lambda x, y: x * y, "extra": lambda x, y: x * y + 1e-3 * w1}, _inputs, repeats=1, warmup=0,
                  memory=False, cliff_threshold=float("inf"), rtol=1.0)
    assert rep["extra"].flags == ["unchecked gradient: closure:0[4x3]"]
    # two candidates holding the same tensors, used in another order: paired by identity (by shape
    # and graph order alone they were swapped, a false mismatch)
    a, b = torch.randn(4, 4, dtype=torch.float64, requires_grad=True), torch.randn(4, 4, dtype=torch.float64,
                                                                                  requires_grad=True)
    square = {"x": torch.randn(3, 4, dtype=torch.float64, requires_grad=True)}
    rep = compare({"ref": lambda x: (x @ a).sin() + x @ b, "other": lambda x: x @ b + (x @ a).sin()},
                  lambda: square, repeats=1, warmup=0, memory=False, cliff_threshold=float("inf"))
    assert rep["other"].flags == [] and set(rep["other"].grad_errors) == {"input:x", "closure:0[4x4]",
                                                                          "closure:1[4x4]"}


def _report_for_plot(flags: dict[str, list[str]], expected: dict[str, list[str]]) -> Report:
    from fastlayers.bench import CandidateResult

    results = [CandidateResult(name, forward_s=[t], forward_backward_s=[3 * t], flags=flags.get(name, []))
               for name, t in (("a", 1e-3), ("b", 2e-3), ("c", 1.5e-3))]
    return Report(workload="w", dtype="float32", device="cpu", threads=1, torch_version="x", cpu="y", repeats=1,
                  warmup=0, reference="a", cliff_threshold=5.0, results=results, expected=expected)


def test_plot_labels_unexpected_flags_only_and_keeps_the_legend_off_the_bars():
    """A candidate whose flags its workload expects is not marked (all were "flagged"); the legend
    overlaps no bar (it sat in the lower right, over the longest); no minor tick is labelled (they
    overlapped on a short log axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    from fastlayers.bench._plot import figure

    rep = _report_for_plot({"b": ["value mismatch", "gradient mismatch: input:x"], "c": ["value mismatch"]},
                           {"b": ["value mismatch", "gradient mismatch"], "c": []})
    fig = figure(rep)
    try:
        ax = fig.axes[0]
        labels = {t.get_text(): t.get_color() for t in ax.get_yticklabels()}
        assert set(labels) == {"a", "b", "c\nvalue mismatch"} and labels["c\nvalue mismatch"] == "crimson"
        fig.canvas.draw()
        legend = ax.get_legend().get_window_extent()
        assert not any(legend.overlaps(bar.get_window_extent()) for bar in ax.patches)
        assert isinstance(ax.xaxis.get_minor_formatter(), NullFormatter)
        assert all(t.get_text() == "" for t in ax.xaxis.get_minorticklabels())
    finally:
        plt.close(fig)


def _load_script(path: str, monkeypatch, fake_compare):
    """A benchmark script as a module, with ``compare`` (and bench_engine's, which rnn scripts
    share) replaced by ``fake_compare``."""
    import importlib.util
    import sys
    from pathlib import Path

    import fastlayers.bench

    script = Path(__file__).resolve().parents[1] / "benchmarks" / path
    monkeypatch.syspath_prepend(str(script.parent))
    monkeypatch.setattr(fastlayers.bench, "compare", fake_compare)
    for name in ("bench_engine", script.stem):
        monkeypatch.delitem(sys.modules, name, raising=False)
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, script.stem, module)
    spec.loader.exec_module(module)
    return module


def _fails_every_check(calls: list):
    """A stand-in for compare: every candidate of a checked comparison fails ("value mismatch",
    not expected); nothing is measured. Records (checked, candidate names) of each call."""
    from fastlayers.bench import CandidateResult

    def fake(candidates, make_inputs, *, check=True, expected=None, anchor=None, workload="w", **kwargs):
        calls.append((check, list(candidates)))
        results = [CandidateResult(n, forward_s=[1e-3], forward_backward_s=[2e-3], peak_memory_bytes=1,
                                   output_error=1.0 if check else None, grad_errors={"input:x": 1.0} if check else {},
                                   flags=["value mismatch"] if check else []) for n in candidates]
        return Report(workload=workload, dtype="float32", device="cpu", threads=1, torch_version="x", cpu="y",
                      repeats=1, warmup=0, reference="r", cliff_threshold=5.0, results=results, checked=check,
                      anchor=anchor, expected={k: list(v) for k, v in (expected or {}).items()})
    return fake


@pytest.mark.parametrize("script,argv", [
    ("rnn/bench_gru_engine.py", ["--size", "small"]),
    ("rnn/bench_engine.py", ["--size", "small"]),
    ("rnn/bench_lengths_paths.py", ["--shapes", "small", "--modes", "GRU"]),
    ("rnn/bench_rnn_lengths.py", ["--size", "small", "--configs", "GRU:padded"]),
    ("rnn/bench_rnn_lengths.py", ["--size", "small", "--configs", "GRU:1"]),
    ("rnn/bench_step_fusion.py", ["--steps", "2", "--repeats", "1"]),
    ("local/bench_local.py", ["--repeats", "1"]),
])
def test_benchmark_scripts_exit_non_zero_when_a_check_fails(script, argv, monkeypatch, capsys):
    """A value or gradient mismatch fails the script (exit status 1, named on stderr); they printed
    it and exited 0. Those that time candidates computing different functions check the pairs
    that must agree first, and time nothing after a failed check."""
    calls: list = []
    module = _load_script(script, monkeypatch, _fails_every_check(calls))
    monkeypatch.setattr("sys.argv", [script, *argv])
    if script.endswith("bench_step_fusion.py"):
        monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)  # (the first call's compile: not the point)
    if script.endswith("bench_local.py"):
        monkeypatch.setattr(module, "copy_bandwidth", lambda: 1e10)  # (its seed-shape forward stays: milliseconds)
    assert module.main() == 1
    assert "check failed" in capsys.readouterr().err
    assert calls and calls[0][0] is True  # the first comparison is a checked one
    if script.endswith("engine.py"):
        assert all(checked for checked, _ in calls)  # nothing timed after the failed check


def test_bench_rnn_lengths_refuses_an_existing_json(tmp_path, monkeypatch, capsys):
    calls: list = []
    module = _load_script("rnn/bench_rnn_lengths.py", monkeypatch, _fails_every_check(calls))
    out = tmp_path / "r.json"
    out.write_text("the user's")
    monkeypatch.setattr("sys.argv", ["bench_rnn_lengths.py", "--size", "small", "--json", str(out)])
    with pytest.raises(SystemExit) as done:
        module.main()
    assert done.value.code == 2 and calls == [] and out.read_text() == "the user's"
    assert capsys.readouterr().err.strip() == (f"bench_rnn_lengths.py: --json {out}: exists; pass --overwrite to "
                                               f"replace it, or name another file")


def test_bench_overhead_compares_the_same_weights_and_checks_first():
    """bench_overhead.py's two columns start from the same weights, and every row that computes the
    same function on both sides agrees in output and gradients (they had other random weights and
    no check); a planted difference is caught. With torch.backends' global flags locked, as
    importing torch.testing's common_utils (some tests do) locks them: the check set cuDNN's TF32
    flag directly, which then raises."""
    import sys
    from pathlib import Path

    import torch.testing._internal.common_utils  # noqa: F401

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import bench_overhead
    finally:
        sys.path.pop(0)
    rows = bench_overhead._rows()
    same = {name: row for name, row in rows.items() if row[5]}
    assert len(same) == 7 and not any("layer_norm" in name or "Locally" in name for name in same)
    for name, (ours, theirs, our_leaves, their_leaves, *_) in same.items():
        assert bench_overhead._mismatch(ours, theirs, our_leaves, their_leaves) is None, name
    ours, theirs, our_leaves, their_leaves, *_ = rows["LSTM(4, 4), T=2, B=1"]
    with torch.no_grad():
        our_leaves[1][0, 0] += 0.1
    assert "output" in bench_overhead._mismatch(ours, theirs, our_leaves, their_leaves)


@pytest.mark.subprocess
def test_bench_native_variant_help():
    """``--help`` printed its usage (it died in int("--help"))."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "rnn" / "bench_native_variant.py"
    proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "REPEATS" in proc.stdout, proc.stderr


def test_workload_sizes_and_repeats_are_checked():
    """A size a workload does not have (it once gave the small shapes silently) and repeats < 1
    (no times, NaN medians) are refused."""
    for name, make in WORKLOADS.items():
        with pytest.raises(ValueError, match=r"^size: expected one of \('small', 'seed'(, 'seed-large')?\), got 'bogus'$"):
            make(size="bogus")
        if name != "local2d":
            with pytest.raises(ValueError, match=r"got 'seed-large'$"):
                make(size="seed-large")
    with pytest.raises(ValueError, match=r"^repeats: expected an int >= 1, got 0$"):
        compare({"a": good}, _inputs, repeats=0)
    with pytest.raises(ValueError, match=r"^warmup: expected an int >= 0, got -1$"):  # (as the CLI's --warmup)
        compare({"a": good}, _inputs, warmup=-1)
