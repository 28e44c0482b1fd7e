"""What a user sees, listed (issue 63: nothing a user sees changes when the internals move): the public
names of each public module, each importable and of the kind it was, and the CLI's commands."""

from __future__ import annotations

import inspect

import torch

import fastlayers
import fastlayers.bench
import fastlayers.functional
import fastlayers.onnx
from fastlayers import cli

PUBLIC = {
    fastlayers: {"LSTM", "GRU", "RNN", "LSTMCell", "GRUCell", "RNNCell", "AttentionPooling", "attention_pool",
                 "LocallyConnected1d", "LocallyConnected2d", "backend", "empty_cache", "ops_library", "__version__"},
    fastlayers.functional: {"attention_pool", "locally_connected1d", "locally_connected2d"},
    fastlayers.onnx: {"export", "translations"},
    fastlayers.bench: {"compare", "Report", "CandidateResult", "Workload", "WORKLOADS"},
}
MODULES = {"LSTM": torch.nn.LSTM, "GRU": torch.nn.GRU, "RNN": torch.nn.RNN, "LSTMCell": torch.nn.LSTMCell,
           "GRUCell": torch.nn.GRUCell, "RNNCell": torch.nn.RNNCell}


def test_public_names_are_the_listed_ones():
    for module, names in PUBLIC.items():
        assert set(module.__all__) == names, module.__name__
        for name in names:
            assert hasattr(module, name), f"{module.__name__}.{name}"


def test_public_names_keep_their_kind():
    for name, base in MODULES.items():
        assert issubclass(getattr(fastlayers, name), base), name  # drop-ins for torch.nn's classes
    for name in ("AttentionPooling", "LocallyConnected1d", "LocallyConnected2d"):
        assert issubclass(getattr(fastlayers, name), torch.nn.Module), name
    for module, names in ((fastlayers, ("attention_pool", "backend", "empty_cache", "ops_library")),
                          (fastlayers.functional, PUBLIC[fastlayers.functional]),
                          (fastlayers.onnx, PUBLIC[fastlayers.onnx]), (fastlayers.bench, ("compare",))):
        for name in names:
            assert callable(getattr(module, name)) and not inspect.isclass(getattr(module, name)), name
    assert fastlayers.functional.attention_pool is fastlayers.attention_pool
    assert isinstance(fastlayers.__version__, str) and fastlayers.__version__


def test_cli_commands(capsys):
    try:
        cli.main(["--help"])
    except SystemExit as e:  # argparse exits after printing the help
        assert e.code == 0
    text = capsys.readouterr().out
    for command in ("demo", "train", "bench", "doctor"):
        assert f"{command}" in text.split("{", 1)[1].split("}", 1)[0], command  # the {demo,train,...} choices
