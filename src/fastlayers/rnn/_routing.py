"""The one table of which engine runs a recurrent layer's call: (cell, backend) -> engine.

The backend is :func:`fastlayers._core.backend.select`'s choice for the call: ``"cpu"`` the C engine
(:mod:`._cpu`), ``"triton"`` the GPU engine (:mod:`._gpu`), ``"reference"`` the
plain-PyTorch twin (:mod:`._reference`). Every engine takes the arguments of
:func:`._cpu.lstm_engine` / :func:`._cpu.gru_engine`. The modules' calls
(:mod:`._modules`) and the operators' eager kernels (:mod:`._ops_export`) both read it here.
"""

from __future__ import annotations

from typing import Callable

from ._cpu import gru_engine, lstm_engine
from ._gpu import gru_engine_gpu, lstm_engine_gpu
from ._reference import gru_reference, lstm_reference

ENGINES: dict[tuple[str, str], Callable] = {
    ("LSTM", "cpu"): lstm_engine, ("LSTM", "triton"): lstm_engine_gpu, ("LSTM", "reference"): lstm_reference,
    ("GRU", "cpu"): gru_engine, ("GRU", "triton"): gru_engine_gpu, ("GRU", "reference"): gru_reference,
}


def engine(cell: str, backend: str) -> Callable:
    """The engine function of ``cell`` ("LSTM", "GRU") on ``backend`` ("cpu", "triton", "reference")."""
    return ENGINES[cell, backend]
