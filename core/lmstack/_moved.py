"""Old import paths of modules that moved into subpackages (plugin API 1.8), kept for plugins
written against 1.7 until plugin API 2.0.

`import lmstack.resolve` still works: a finder on `sys.meta_path` answers the old name with the
module at its new place (the same module object, so `isinstance` and monkeypatching agree) and
warns once per name with a `DeprecationWarning` that names the new path. No file stays behind at
the old place: the core's top level lists only what lives there.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED: dict[str, str] = {
    "lmstack.async_engine": "lmstack.engine.async_engine",
    "lmstack.llm": "lmstack.engine.llm",
    "lmstack.input_processor": "lmstack.engine.input_processor",
    "lmstack.output_processor": "lmstack.engine.output_processor",
    "lmstack.planner": "lmstack.engine.planner",
    "lmstack.step_cost": "lmstack.engine.step_cost",
    "lmstack.config": "lmstack.stack.config",
    "lmstack.resolve": "lmstack.stack.resolve",
    "lmstack.build": "lmstack.stack.build",
    "lmstack.plugins": "lmstack.stack.plugins",
    "lmstack.executor": "lmstack.exec.executor",
    "lmstack.multiproc": "lmstack.exec.multiproc",
    "lmstack.distributed": "lmstack.exec.distributed",
    "lmstack.model_runner": "lmstack.exec.model_runner",
    "lmstack.parallel_layout": "lmstack.exec.parallel_layout",
    "lmstack.sampler": "lmstack.sample.sampler",
    "lmstack.step_sampler": "lmstack.sample.step_sampler",
    "lmstack.grammar": "lmstack.sample.grammar",
    "lmstack.verification": "lmstack.sample.verification",
    "lmstack.drafts": "lmstack.spec.drafts",
    "lmstack.draft_policy": "lmstack.spec.draft_policy",
    "lmstack.native": "lmstack.kernels.native",
    "lmstack.triton_support": "lmstack.kernels.triton_support",
    "lmstack.scratch": "lmstack.kernels.scratch",
    "lmstack.hardware": "lmstack.kernels.hardware",
    "lmstack.quant_format": "lmstack.quant.formats",
    "lmstack.kv_quant": "lmstack.quant.kv",
    "lmstack.cli_generate": "lmstack.commands.generate",
    "lmstack.scaffold": "lmstack.commands.new_plugin",
    "lmstack.progress": "lmstack.commands.progress",
    "lmstack.comm_stats": "lmstack.testing.comm_stats",
    # Offline quantization left the serving core for the lmstack-calibrate distribution: these
    # import when it is installed (`CalibrationModel` is gone: `lmstack_calibrate.model.DenseModel`).
    "lmstack.awq_search": "lmstack_calibrate.awq_search",
    "lmstack.scale_tuning": "lmstack_calibrate.scale_tuning",
    "lmstack.quantize": "lmstack_calibrate.quantize",
    "lmstack.evaluate": "lmstack_calibrate.perplexity",
}
"""Old module name -> where it lives now. (`lmstack.engine` kept its name: it is now the package
that re-exports `LLMEngine`.)"""


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new} (plugin API 1.8); the old path goes away in plugin API 2.0",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(new)
        self._spec = module.__spec__  # the import system overwrites __spec__; exec_module restores it
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec


def install_moved_module_finder() -> None:
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
