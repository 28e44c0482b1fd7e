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
    module classes and the cell options they hold, which rebuild from tensors and plain values."""
    import torch

    from .rnn._options import CellOptions

    torch.serialization.add_safe_globals([LSTM, GRU, RNN, LSTMCell, GRUCell, RNNCell, AttentionPooling,
                                          LocallyConnected1d, LocallyConnected2d, CellOptions])


_allow_whole_module_loads()


def ops_library() -> str:
    """The path of fastlayers' C++ operator library (built on first call, about 15 s, then cached):
    what a process without fastlayers loads (``torch.ops.load_library(path)``, or ``dlopen`` from
    C++) to run AOTInductor packages of models built from fastlayers layers (docs/deploy.md).

    Raises:
        RuntimeError: it cannot be built here (no C / C++ compiler, or a failed build), with why.
    """
    from ._native.ops_lib import library_path

    return library_path()


def __getattr__(name: str):
    """``fastlayers.onnx`` imported on first use (it is the only module that needs onnxscript)."""
    if name == "onnx":
        import importlib

        return importlib.import_module(".onnx", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LSTM", "GRU", "RNN", "LSTMCell", "GRUCell", "RNNCell", "AttentionPooling", "attention_pool", "LocallyConnected1d", "LocallyConnected2d", "backend", "empty_cache", "ops_library", "__version__"]
