"""fastlayers: fast, verified, differentiable layers for PyTorch."""

from . import _triton  # noqa: F401  (registers the Triton ops where the triton package imports)
from ._backend import backend as backend
from ._pool import empty_cache as empty_cache
from .attention import AttentionPooling as AttentionPooling, attention_pool as attention_pool
from .local import LocallyConnected1d as LocallyConnected1d, LocallyConnected2d as LocallyConnected2d
from .rnn import GRU as GRU, LSTM as LSTM, RNN as RNN
from .rnn import GRUCell as GRUCell, LSTMCell as LSTMCell, RNNCell as RNNCell

__version__ = "0.1.0"

__all__ = ["LSTM", "GRU", "RNN", "LSTMCell", "GRUCell", "RNNCell", "AttentionPooling", "attention_pool", "LocallyConnected1d", "LocallyConnected2d", "backend", "empty_cache", "__version__"]
