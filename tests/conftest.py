import os

import pytest
import torch
from hypothesis import settings

if not torch.cuda.is_available():
    # Triton's interpreter runs the Triton kernels on CPU tensors; it must be on before any kernel
    # is decorated (fastlayers._triton imports them lazily, when a call first forces "triton")
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    import triton_interpreter  # the language patched once per launch (its docstring), a third off each kernel

    triton_interpreter.install()

# make test runs the suite in one process per core (pytest-xdist): each takes its share of the cores
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _workers))
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.load_profile("ci")


def pytest_addoption(parser):
    parser.addoption("--poison-memory", action="store_true",
                     help="torch.use_deterministic_algorithms(True) and fill_uninitialized_memory: every "
                          "torch.empty & co. is filled with NaN, so a read of memory nobody wrote fails a test")


def pytest_configure(config):
    if config.getoption("--poison-memory"):
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = True


def pytest_report_header(config):
    lines = []
    try:
        import triton

        lines.append(f"triton {triton.__version__} ({'interpreter' if os.environ.get('TRITON_INTERPRET') == '1' else 'GPU'})")
    except ImportError:
        lines.append("triton: not installed")
    if config.getoption("--poison-memory"):
        lines.append("fastlayers: uninitialised memory poisoned (NaN), deterministic algorithms on")
    return lines


@pytest.fixture(autouse=True)
def _poison_still_on(request):
    """A test must not switch the poisoning off for the tests after it."""
    yield
    if request.config.getoption("--poison-memory"):
        assert torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory
