"""Whole modules saved and loaded the way torch 2.13 users do it: ``torch.save(model, f)`` and
``torch.load(f)``, whose default ``weights_only=True`` unpickles only allowlisted globals. Importing
fastlayers allowlists its public modules and the cell options they hold, so every module, with
every option, loads with nothing allowlisted by the user, in this process and in a fresh one, and
computes what it computed before (issue 62)."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch
from torch import nn

import fastlayers
from module_cases import CASE_IDS, CASES, run


def _round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)  # weights_only=True, torch's default


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_whole_module_loads_with_weights_only_and_computes_the_same(case):
    torch.manual_seed(0)
    module = case.build().eval()
    loaded = _round_trip(module)
    assert type(loaded) is type(module) and repr(loaded) == repr(module)
    assert loaded.state_dict().keys() == module.state_dict().keys()
    for name, value in module.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    (outs, grads), (outs2, grads2) = run(module, case), run(loaded, case)
    for a, b in zip(outs, outs2, strict=True):
        assert torch.equal(a, b)
    assert grads.keys() == grads2.keys()
    for name in grads:
        assert (grads[name] is None) == (grads2[name] is None) and (
            grads[name] is None or torch.equal(grads[name], grads2[name])), name


def test_module_options_beyond_the_state_dict_survive_the_round_trip():
    lstm = fastlayers.LSTM(4, 3, bidirectional=True, layer_norm=True, peephole=True, cell_clip=2.0,
                           zoneout=(0.1, 0.2), recurrent_dropout=0.1, proj_size=2, checkpoint_every=5)
    loaded = _round_trip(lstm)
    assert loaded.options == lstm.options and loaded.checkpoint_every == 5 and loaded.proj_size == 2


def test_a_step_view_loads_with_its_layer_and_keeps_sharing_it():
    """``LSTM.cell()`` / ``GRU.cell()`` views kept in a model (a decoder's step): the view class
    was missing from the allowlist, so the whole model failed to load with weights_only=True."""
    for layer in (fastlayers.LSTM(4, 5, layer_norm=True), fastlayers.GRU(4, 5)):
        model = nn.ModuleDict({"layer": layer, "step": layer.cell(0, 0)})
        with torch.serialization.safe_globals([nn.ModuleDict]):  # the user's container: theirs to allow
            loaded = _round_trip(model)
        assert loaded["step"]._rnn[0] is loaded["layer"]
        x = torch.randn(2, 4)
        want, got = model["step"](x), loaded["step"](x)
        for a, b in zip(*(((w,) if isinstance(w, torch.Tensor) else w) for w in (want, got)), strict=True):
            assert torch.equal(a, b)


class _LanguageModel(nn.Module):  # as PyTorch's word_language_model example's RNNModel, with fastlayers' LSTM
    def __init__(self):
        super().__init__()
        self.encoder = nn.Embedding(20, 8)
        self.rnn = fastlayers.LSTM(8, 6, num_layers=2, dropout=0.2, layer_norm=True)
        self.decoder = nn.Linear(6, 20)

    def forward(self, tokens):
        return self.decoder(self.rnn(self.encoder(tokens))[0])


@pytest.mark.subprocess
def test_a_users_model_loads_in_a_fresh_process_with_only_its_own_classes_allowlisted(tmp_path):
    """The user allowlists what is theirs and torch's (their model class, nn.Embedding, nn.Linear),
    as they must for any whole-model pickle; fastlayers' classes need nothing."""
    torch.manual_seed(0)
    model = _LanguageModel().eval()
    tokens = torch.randint(0, 20, (7, 3))
    path = tmp_path / "model.pt"
    torch.save(model, path)
    torch.save(model(tokens).detach(), tmp_path / "want.pt")
    torch.save(tokens, tmp_path / "tokens.pt")
    script = f"""
import sys, torch
sys.path.insert(0, {str(tmp_path)!r})
from torch import nn
import fastlayers  # what the user's model module imports
sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
from test_serialization import _LanguageModel
torch.serialization.add_safe_globals([_LanguageModel, nn.Embedding, nn.Linear])
model = torch.load({str(path)!r})
want = torch.load({str(tmp_path / "want.pt")!r})
tokens = torch.load({str(tmp_path / "tokens.pt")!r})
assert type(model.rnn) is fastlayers.LSTM
assert torch.equal(model(tokens), want)
print("loaded")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stderr[-3000:]
