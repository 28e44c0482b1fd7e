"""The test suite's one change to Triton's interpreter (``TRITON_INTERPRET=1``): the Triton language
is patched once per kernel launch, not again at every call of a ``@triton.jit`` helper inside it.

Triton's interpreter (3.6.0 and 3.9.0, ``triton/runtime/interpreter.py``) swaps the builtins of
``triton.language`` for interpreted ones in ``_patch_lang`` when a launch starts and restores them
when it ends; it also calls ``_patch_lang`` at the start of every call of a device function (a
``@triton.jit`` helper called from a kernel) and drops the scope it returns. Inside a launch that
second patch finds every builtin already swapped and changes nothing that the launch's own patch
did not, yet it walks the modules' members with ``inspect.getmembers`` each time: about 0.85 ms a
call, a third of the interpreter's time on the recurrent kernels (a 2-layer bidirectional LSTM with
every option, T = 9, B = 5: 6,360 helper calls per forward and backward, 48 launches). With
:func:`install`, a call of ``_patch_lang`` while a launch's patch is in place does nothing; the
launch's own patch and restore, and every kernel and helper, run as Triton runs them. This holds for
fastlayers' kernels, whose modules see the language only as ``triton.language`` (the module the
launch patches), never ``triton.language.core`` alone. Not used on a GPU.
"""

from __future__ import annotations

import threading


class _Nothing:
    def restore(self) -> None:
        pass


def install() -> bool:
    """Patch the language once per launch (see the module's docstring); False where this Triton's
    interpreter has no ``_patch_lang`` (then nothing changes)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    if original is None:
        return False
    if getattr(original, "once_per_launch", False):
        return True
    import triton.language as tl

    state = threading.local()

    class _Restore:
        def __init__(self, scope):
            self.scope = scope

        def restore(self) -> None:
            try:
                self.scope.restore()
            finally:
                state.patched = frozenset()

    def patch_lang(fn):
        langs = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        patched = getattr(state, "patched", frozenset())
        if patched and langs <= patched:  # inside a launch whose patches cover fn's modules
            return _Nothing()
        scope = original(fn)
        state.patched = patched | langs
        return _Restore(scope) if not patched else scope

    patch_lang.once_per_launch = True
    patch_lang.original = original
    interpreter._patch_lang = patch_lang
    return True
