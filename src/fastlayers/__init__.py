"""fastlayers: fast, verified, differentiable layers for PyTorch."""

from .rnn import GRU as GRU, LSTM as LSTM, RNN as RNN

__version__ = "0.1.0"

__all__ = ["LSTM", "GRU", "RNN", "__version__"]
