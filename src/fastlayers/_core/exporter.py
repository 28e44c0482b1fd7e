"""fastlayers' ONNX translations, registered where torch.onnx's exporter looks for them.

``torch.onnx.export(model, args, dynamo=True)`` builds its table of ONNX translations from
onnxscript's torchlib registry (``onnxscript.function_libs.torch_lib.registration.default_registry``,
read by ``ONNXRegistry.from_torchlib`` before the trace), plus the call's
``custom_translation_table``. Each layer family hands :func:`offer` a function returning its
``{"fastlayers::<op>": translation}`` table when it is imported; the tables go into that registry
the moment onnxscript's registration module is imported (at once where it is imported already), so
the plain call needs no table of ours, for a module or an ``ExportedProgram`` alike.

``import fastlayers`` does not import onnxscript (about 1 s): a finder on ``sys.meta_path`` waits for
that one module name, lets the other finders find it and registers the tables after the module runs,
then leaves ``sys.meta_path``. A registration that fails (an onnxscript whose registry changed) warns
once; ``fastlayers.onnx.export`` and ``custom_translation_table=fastlayers.onnx.translations()`` do
not depend on it. A name the registry holds already (a user's own translation) is left as it is.
This module imports nothing of fastlayers.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

REGISTRY_MODULE = "onnxscript.function_libs.torch_lib.registration"

Tables = Callable[[], "dict[str, Callable[..., Any]]"]
_tables: list[Tables] = []


def offer(translations: Tables) -> None:
    """Register ``translations()`` (``{"fastlayers::<op>": function}``) in onnxscript's torchlib
    registry: now where onnxscript's registration module is imported, else once it is."""
    _tables.append(translations)
    module = sys.modules.get(REGISTRY_MODULE)
    if module is not None and getattr(module, "default_registry", None) is not None:
        _register(module, [translations])
    elif not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def _register(module: ModuleType, tables: list[Tables]) -> None:
    try:
        import onnxscript

        registry = module.default_registry
        opset = onnxscript.values.Opset(domain="pkg.fastlayers", version=1)
        for tables_fn in tables:
            for name, function in tables_fn().items():
                if name not in registry:
                    traced = onnxscript.values.TracedOnnxFunction(opset, function)
                    traced.function_ir  # what torch's registry reads: raises here, not in every export
                    registry.register(traced, name)
    except Exception as exc:  # a speed-and-convenience path: warn, never break the user's import
        warnings.warn(f"fastlayers: could not register its ONNX translations with onnxscript's registry "
                      f"({type(exc).__name__}: {exc}); torch.onnx.export of a model holding fastlayers "
                      "layers needs custom_translation_table=fastlayers.onnx.translations() "
                      "(or fastlayers.onnx.export)", RuntimeWarning, stacklevel=2)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for :data:`REGISTRY_MODULE` it asks the finders after it and wraps the
    loader so that :func:`_register` runs once the module has run."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname != REGISTRY_MODULE:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


class _RegisteringLoader(importlib.abc.Loader):
    """The module's own loader, with :func:`_register` after ``exec_module``."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _register(module, list(_tables))

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...: the module's own loader
        return getattr(self._loader, name)
