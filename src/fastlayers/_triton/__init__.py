"""Triton kernels (GPU; CPU tensors under Triton's interpreter, ``TRITON_INTERPRET=1``).

One module per op family, mirroring ``_native``: :mod:`.local` (locally connected 2-D forward and
both gradients), :mod:`.attention` (masked attention pooling, dot and scaled-dot scores),
:mod:`.lstm` and :mod:`.gru` (the recurrent engine's step kernels, :mod:`fastlayers.rnn._gpu`). They
import only when the ``triton`` package does; :func:`available` says whether it does. The ops
they provide are listed in :mod:`fastlayers._core.backend` (``TRITON_OPS``, a static table: this
package imports nothing of the layers or of the backend choice).
"""

from __future__ import annotations

import importlib.util
import os


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the host's grid arithmetic: Triton 3.6's ``triton.cdiv`` and
    ``triton.next_power_of_2`` are constexpr functions whose every host call unwraps its arguments
    (about 5 us per call on the H200's host, 2026-11-26: 30 us of a small layer call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), in plain Python (see :func:`cdiv`)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's interpreter, read as Triton reads it (its
    ``getenv_bool``: ``1``, ``true``, ``on`` or ``yes``, any case, nothing around it)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")

