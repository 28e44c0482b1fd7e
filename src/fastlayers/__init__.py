"""fastlayers: fast, verified, differentiable layers for PyTorch."""

from . import _triton  # noqa: F401  (registers the Triton ops where the triton package imports)
from ._core.backend import backend as backend
from ._core.pool import empty_cache as empty_cache
from .attention import AttentionPooling as AttentionPooling, attention_pool as attention_pool
from .local import LocallyConnected1d as LocallyConnected1d, LocallyConnected2d as LocallyConnected2d
from .rnn import GRU as GRU, LSTM as LSTM, RNN as RNN
from .rnn import GRUCell as GRUCell, LSTMCell as LSTMCell, RNNCell as RNNCell

__version__ = "0.1.0"


def _allow_whole_module_loads() -> None:
    """A whole pickled fastlayers module (``torch.save(model, f)``) loads with ``torch.load(f)``, whose
    ``weights_only=True`` default (torch >= 2.6) unpickles allowlisted globals only: the public
    module classes (and the step views that ``LSTM.cell()`` returns) and the cell options they
    hold, which rebuild from tensors and plain values."""
    import torch

    from .rnn._modules import CellView
    from .rnn._options import CellOptions

    torch.serialization.add_safe_globals([LSTM, GRU, RNN, LSTMCell, GRUCell, RNNCell, AttentionPooling,
                                          LocallyConnected1d, LocallyConnected2d, CellOptions, CellView])


_allow_whole_module_loads()


def ops_library() -> str:
    """The path (a str) of fastlayers' native library: the C++ operators and the C kernels, as
    built with the package, in the CPU variant this process loads (``fastlayers/_native/
    _C_<variant>.so``, variant ``default``, ``avx2`` or ``avx512``; ``FASTLAYERS_CPU_CAPABILITY``
    forces one). What a process without fastlayers loads (``torch.ops.load_library(path)``, or
    ``dlopen`` from C++) to run AOTInductor packages of models built from fastlayers layers
    (docs/deploy.md). Nothing is compiled. In this process it also loads the library and registers
    the operators' Python half (fake functions and autograd), so a program loaded with
    ``torch.export.load`` after ``torch.ops.load_library(fastlayers.ops_library())`` trains,
    re-exports and compiles as the exporting process's does.

    Raises:
        RuntimeError: the library is unavailable (a checkout that was not built, a library built
            against another torch, or ``FASTLAYERS_NO_NATIVE=1``), with why.
    """
    from ._native import ops_lib

    path = ops_lib.library_path()
    ops_lib.load()  # (the fake functions and autograd: without them a loaded program's gradients are None)
    return path


_SUBMODULES = ("functional", "onnx", "bench", "data", "train")  # (the public ones: docs/api.rst)


def __getattr__(name: str):
    """The public submodules (``fastlayers.functional``, ``onnx``, ``bench``, ``data``, ``train``) on
    first use, as ``torch.nn.functional`` after ``import torch``: ``import fastlayers`` does not import
    them (``onnx`` needs onnxscript; ``train`` and ``data`` their own dependencies)."""
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LSTM", "GRU", "RNN", "LSTMCell", "GRUCell", "RNNCell", "AttentionPooling", "attention_pool", "LocallyConnected1d", "LocallyConnected2d", "backend", "empty_cache", "ops_library", "__version__"]
