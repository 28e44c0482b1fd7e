"""fastlayers._triton._launch: a kernel's compiled variant is reused only for a call whose signature
(ints' specialization classes, tensor dtypes and 16-byte alignment, constexprs, options, current
device) it was compiled for; everything else takes Triton's own path. Fake kernels and CUDA-flagged CPU tensors:
no GPU needed (tests/test_cuda.py runs the real kernels through it)."""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("triton")

from fastlayers._triton import _launch  # noqa: E402


class _Cuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA device 0 (only the launcher's checks look)."""

    index = 0

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def get_device(self) -> int:  # type: ignore[override]
        return self.index


class _Cuda1(_Cuda):
    index = 1


class _Compiled:
    function, packed_metadata = "function", "packed"

    def __init__(self, log: list) -> None:
        self.log = log

    def run(self, *args) -> None:
        self.log.append(("direct", args))


class _Kernel:
    """Records Triton-path launches (kernel[grid](*args, **options)) and returns a compiled kernel."""

    def __init__(self) -> None:
        self.log: list = []

    def __getitem__(self, grid):
        def call(*args, **options):
            self.log.append(("triton", grid, args, options))
            return _Compiled(self.log)
        return call


class _Driver:
    class active:  # noqa: N801 - Triton's attribute name
        current = 0

        @classmethod
        def get_current_device(cls) -> int:
            return cls.current

        @staticmethod
        def get_current_stream(device: int) -> str:
            return f"stream{device}"


@pytest.fixture
def cuda_launch(monkeypatch):
    monkeypatch.setattr(_launch, "SUPPORTED", True)
    monkeypatch.setattr(_launch, "_driver", _Driver)
    monkeypatch.setattr(_launch, "_CACHE", {})
    return _Kernel()


def _tensor(offset: int = 0) -> torch.Tensor:
    return torch.zeros(8 + offset)[offset:].as_subclass(_Cuda)


def test_a_repeated_signature_calls_the_compiled_launcher(cuda_launch):
    x = _tensor()
    _launch.launch(cuda_launch, (3,), (x, 5, 4), {"F": True}, num_warps=4)
    _launch.launch(cuda_launch, (7, 2), (x, 5, 4), {"F": True}, num_warps=4)
    assert [entry[0] for entry in cuda_launch.log] == ["triton", "direct"]
    assert cuda_launch.log[0][2:] == ((x, 5, 4), {"F": True, "num_warps": 4})  # Triton's path: constexprs by name
    assert cuda_launch.log[1][1] == (7, 2, 1, "stream0", "function", "packed", None, None, None, x, 5, 4, True)


def test_tensors_on_another_gpu_launch_with_that_gpu_current(cuda_launch, monkeypatch):
    """Triton launches on the current device (and its stream): a layer's tensors on cuda:1 while
    cuda:0 is current launch inside torch.cuda.device(1), Triton's path first, then the direct one
    on device 1's stream; the current device is 0 again after each."""
    entered = []

    @contextlib.contextmanager
    def on_device(index):
        entered.append(index)
        before, _Driver.active.current = _Driver.active.current, index
        try:
            yield
        finally:
            _Driver.active.current = before

    monkeypatch.setattr(_launch, "_on_device", on_device)
    x = torch.zeros(8).as_subclass(_Cuda1)
    for _ in range(2):
        _launch.launch(cuda_launch, (3,), (x, 5), {}, num_warps=4)
        assert _Driver.active.current == 0
    assert entered == [1, 1]
    assert [entry[0] for entry in cuda_launch.log] == ["triton", "direct"]
    assert cuda_launch.log[1][1][3] == "stream1"
    _launch.launch(cuda_launch, (3,), (_tensor(), 5), {}, num_warps=4)  # device 0: compiled for it separately
    assert entered == [1, 1] and cuda_launch.log[-1][0] == "triton"


def test_ints_of_one_class_share_the_compiled_kernel_with_their_own_values(cuda_launch):
    """A time loop's step index: one compiled kernel, each launch with its value."""
    x = _tensor()
    for j in (5, 7, 2**30 + 3):
        _launch.launch(cuda_launch, (1,), (x, j), {}, num_warps=4)
    assert [entry[0] for entry in cuda_launch.log] == ["triton", "direct", "direct"]
    assert [entry[1][-1] for entry in cuda_launch.log[1:]] == [7, 2**30 + 3]


@pytest.mark.parametrize("change", ["one", "divisible", "int64", "uint64", "alignment", "dtype", "constexpr",
                                    "options"])
def test_any_change_of_signature_takes_tritons_path(cuda_launch, change):
    """Triton specializes an int equal to 1, divisible by 16, or past 32 / 63 bits: each a new call."""
    x = _tensor()
    args, constexprs, options = (x, 5, 4), {"F": True}, {"num_warps": 4}
    _launch.launch(cuda_launch, (3,), args, constexprs, **options)
    if change in ("one", "divisible", "int64", "uint64"):
        args = (x, {"one": 1, "divisible": 32, "int64": 2**31 + 5, "uint64": 2**63 + 5}[change], 4)
    elif change == "alignment":
        args = (_tensor(offset=1), 5, 4)  # 4 bytes past an aligned address
    elif change == "dtype":
        args = (x.double(), 5, 4)
    elif change == "constexpr":
        constexprs = {"F": False}
    else:
        options = {"num_warps": 8}
    _launch.launch(cuda_launch, (3,), args, constexprs, **options)
    assert [entry[0] for entry in cuda_launch.log] == ["triton", "triton"]


def test_cpu_tensors_hooks_and_other_versions_take_tritons_path(cuda_launch, monkeypatch):
    cpu = torch.zeros(8)
    for _ in range(2):
        _launch.launch(cuda_launch, (1,), (cpu, 5), {}, num_warps=4)
    assert [entry[0] for entry in cuda_launch.log] == ["triton", "triton"]
    x = _tensor()
    hook = _launch._knobs.runtime.launch_enter_hook
    hook.add(print)  # a profiler's hook
    try:
        for _ in range(2):
            _launch.launch(cuda_launch, (1,), (x, 5), {}, num_warps=4)
    finally:
        hook.remove(print)
    monkeypatch.setattr(_launch, "SUPPORTED", False)
    for _ in range(2):
        _launch.launch(cuda_launch, (1,), (x, 5), {}, num_warps=4)
    assert [entry[0] for entry in cuda_launch.log] == ["triton"] * 6


def test_the_cache_starts_over_past_its_bound(cuda_launch, monkeypatch):
    monkeypatch.setattr(_launch, "_MAX_ENTRIES", 3)
    x = _tensor()
    for n in range(5):
        _launch.launch(cuda_launch, (1,), (x, 3), {"N": n}, num_warps=4)
    assert len(_launch._CACHE[cuda_launch]) == 2  # cleared at the 4th signature, which then went in
    _launch.launch(cuda_launch, (1,), (x, 3), {"N": 4}, num_warps=4)
    assert cuda_launch.log[-1][0] == "direct"


def test_constexprs_out_of_the_kernels_order_are_refused(cuda_launch):
    """The launcher takes constexprs by position: named out of order, a first call raises (on CPU
    tensors too, so the interpreter tests check every kernel's call)."""
    cuda_launch.arg_names = ["x", "n", "A", "B"]
    with pytest.raises(AssertionError, match="not the kernel's parameters"):
        _launch.launch(cuda_launch, (1,), (_tensor(), 3), {"B": 1, "A": 2}, num_warps=4)
    with pytest.raises(AssertionError, match="not the kernel's parameters"):
        _launch.launch(cuda_launch, (1,), (torch.zeros(8), 3), {"B": 1, "A": 2}, num_warps=4)
    _launch.launch(cuda_launch, (1,), (_tensor(), 3), {"A": 2, "B": 1}, num_warps=4)
    assert [entry[0] for entry in cuda_launch.log] == ["triton"]
