"""Recurrent layers: drop-in torch.nn.LSTM/GRU/RNN with per-sequence lengths."""

from ._cells import GRUCell as GRUCell, LSTMCell as LSTMCell, RNNCell as RNNCell
from ._modules import GRU as GRU, LSTM as LSTM, RNN as RNN
from ._reference import reference_varlen_rnn as reference_varlen_rnn
from ._varlen import varlen_rnn as varlen_rnn

__all__ = ["LSTM", "GRU", "RNN", "LSTMCell", "GRUCell", "RNNCell", "varlen_rnn", "reference_varlen_rnn"]
