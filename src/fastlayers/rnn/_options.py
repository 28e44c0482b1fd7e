"""Cell options of the recurrent engine, validated once (errors name the option, expected vs got)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

LAYER_NORM_MODES = (False, True)


@dataclass(frozen=True)
class CellOptions:
    """LSTM cell options beyond torch.nn.LSTM. All defaults = plain torch.nn.LSTM math.

    layer_norm: LayerNorm on the input and recurrent pre-activations (gain only) and on the cell
        state before its tanh (gain and bias), as haste's LayerNormLSTM (Ba et al. 2016).
    peephole: diagonal peephole weights from the cell state into i, f (c_{t-1}) and o (c_t)
        (Gers & Schmidhuber 2000; oneDNN's peephole LSTM).
    cell_clip: clip the cell state to [-cell_clip, cell_clip] after each update (cuDNN/TF).
    zoneout: (z_h, z_c): each unit keeps its previous value with that probability in training,
        the expectation in eval (Krueger et al. 2016).
    recurrent_dropout: one dropout mask per sequence on h_{t-1} before the recurrent matrix,
        the same at every step (Gal & Ghahramani 2016); identity in eval.
    proj_clip: clip the projected output W_hr h to [-proj_clip, proj_clip] (TF's LSTMCell
        proj_clip; needs proj_size > 0).
    """

    layer_norm: bool = False
    peephole: bool = False
    cell_clip: float | None = None
    zoneout: tuple[float, float] = (0.0, 0.0)
    recurrent_dropout: float = 0.0
    proj_clip: float | None = None

    def __post_init__(self) -> None:
        # ``plain``: True when the options change no math (the vendor kernel applies). A plain instance
        # attribute, set here (a frozen dataclass sets its own through object.__setattr__): read on
        # every call, and traceable by torch.compile, which refused functools.cached_property's lock
        # (Python 3.11) at a first read under Dynamo ("Unsupported context manager")
        object.__setattr__(self, "plain", not self.layer_norm and not self.peephole and self.cell_clip is None
                           and self.proj_clip is None and tuple(self.zoneout) == (0.0, 0.0)
                           and self.recurrent_dropout == 0.0)

    def __getattr__(self, name: str):
        if name == "plain":  # an instance unpickled from a release that cached it lazily
            self.__post_init__()
            return self.__dict__["plain"]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def changed(self) -> dict[str, object]:
        """The options that differ from their defaults, by name (for reprs)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default}

    @classmethod
    def make_gru(cls, layer_norm=False, zoneout=None, recurrent_dropout=0.0) -> "CellOptions":
        """The GRU's options (layer_norm, one zoneout probability for its one state, recurrent_dropout)."""
        if zoneout is not None and (isinstance(zoneout, bool) or not isinstance(zoneout, (int, float))):
            raise TypeError(f"zoneout: expected one probability (a GRU has one state), got {zoneout!r}")
        return cls.make(layer_norm, False, None, (zoneout or 0.0, 0.0), recurrent_dropout)

    @classmethod
    def make(cls, layer_norm=False, peephole=False, cell_clip=None, zoneout=None, recurrent_dropout=0.0,
             proj_clip=None) -> "CellOptions":
        if not isinstance(layer_norm, bool):
            raise ValueError(f"layer_norm: expected True or False (the haste-style LayerNorm cell), got {layer_norm!r}")
        if not isinstance(peephole, bool):
            raise TypeError(f"peephole: expected a bool, got {peephole!r}")
        cell_clip, proj_clip = _clip("cell_clip", cell_clip), _clip("proj_clip", proj_clip)
        if zoneout is None:
            zoneout = (0.0, 0.0)
        elif isinstance(zoneout, (int, float)) and not isinstance(zoneout, bool):
            zoneout = (float(zoneout), float(zoneout))
        if not isinstance(zoneout, (tuple, list)) or len(zoneout) != 2:
            raise TypeError(f"zoneout: expected a probability or a pair (z_h, z_c), got {zoneout!r}")
        for name, z in zip(("zoneout[0] (z_h)", "zoneout[1] (z_c)"), zoneout):
            if isinstance(z, bool) or not isinstance(z, (int, float)) or not 0 <= z < 1:
                raise ValueError(f"{name}: expected a probability in [0, 1), got {z!r}")
        if isinstance(recurrent_dropout, bool) or not isinstance(recurrent_dropout, (int, float)) \
                or not 0 <= recurrent_dropout < 1:
            raise ValueError(f"recurrent_dropout: expected a probability in [0, 1), got {recurrent_dropout!r}")
        return cls(bool(layer_norm), peephole, cell_clip, (float(zoneout[0]), float(zoneout[1])),
                   float(recurrent_dropout), proj_clip)


def _clip(name: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}: expected None or a number > 0, got {value!r}")
    return float(value)
