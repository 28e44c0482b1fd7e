"""Triton kernels (GPU; CPU tensors under Triton's interpreter, ``TRITON_INTERPRET=1``).

One module per op family, mirroring ``_native``: :mod:`.local` (locally connected 2-D forward and
both gradients), :mod:`.attention` (masked attention pooling, dot and scaled-dot scores),
:mod:`.lstm` and :mod:`.gru` (the recurrent engine's step kernels, :mod:`fastlayers.rnn._engine_gpu`). They
import only when the ``triton`` package does; :func:`available` says whether it did, and the
ops they provide are registered with :mod:`fastlayers._backend` (``TRITON_OPS``).
"""

from __future__ import annotations

import importlib.util

from .. import _backend

OPS = ("local2d", "attention", "lstm", "gru")


def available() -> bool:
    return importlib.util.find_spec("triton") is not None


if available():
    _backend.TRITON_OPS.update(OPS)
