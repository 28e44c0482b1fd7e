"""What only torch.compile's tracing calls, in a module of its own imported at that moment.

Its decorators import ``torch._dynamo`` (about 1 s), which ``import fastlayers`` must not pay: the
eager functions import this module from their ``torch.compiler.is_compiling()`` branch, when
torch.compile is tracing and has imported Dynamo already (Dynamo runs the import itself, so the
decorated functions below are real functions it sees as marked). It imports nothing of
fastlayers: each caller passes the function to run (a plain module-level function for
:func:`constant`), so the modules that decide stay below it in the import graph.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


@torch.compiler.assume_constant_result
def constant(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` evaluated once while tracing and kept by the compiled code as a constant: the
    backend choice (it depends on the device and dtype, which the compiled code guards on, and on
    the forced backend at that time), a fact of the machine (hardware bf16 products), whether the
    operator library loads (it builds, once, at trace time). ``args``: constants, or tensors (read
    as their example values)."""
    return fn(*args)


@torch.compiler.disable
def eagerly(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` outside the compiled graph (one graph break): a recurrent layer's call
    with lengths under torch.compile, whose plan reads the lengths' values on the host (no
    recompilation for new lengths); the engine's kernels run as in eager mode."""
    return fn(*args, **kwargs)
