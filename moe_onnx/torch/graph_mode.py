"""TorchAir's graph-mode entry points on a CPU: ``torch.compile(model, backend=npu_backend)``.

The seeds' graph-mode examples (seed 003) build a backend with
``torchair.get_npu_backend(compiler_config=CompilerConfig())`` and compile with it. On a CPU
the same ``torch.compile`` call runs inductor, which calls our ops as they run eagerly (the
eager bits). After :func:`moe_onnx.torch.install_stand_ins`, ``import torchair`` and
``from torchair.configs.compiler_config import CompilerConfig`` give :data:`NAMES` and
:data:`CONFIG_NAMES`.

TorchAir's compiler options tune the NPU's graph compiler. The ones known not to change what a
graph computes are accepted; any other option set is refused by name (never ignored).
"""

from __future__ import annotations

from typing import Any

#: options of TorchAir's CompilerConfig that do not change what a graph computes:
#: keep_inference_input_mutations keeps an input's in-place update in the graph, as inductor does
HARMLESS_OPTIONS = {"experimental_config": {"keep_inference_input_mutations"}}


class _Options:
    """A group of TorchAir options (``config.experimental_config``): any may be set; which are
    read is decided by :func:`get_npu_backend`."""

    def __init__(self, group: str):
        object.__setattr__(self, "_group", group)
        object.__setattr__(self, "_set", {})

    def __setattr__(self, name: str, value: Any) -> None:
        self._set[name] = value

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._set[name]
        except KeyError:
            raise AttributeError(f"CompilerConfig.{self._group}.{name} has not been set") from None


class CompilerConfig:
    """torchair.configs.compiler_config.CompilerConfig on a CPU: the option groups real code sets
    (``experimental_config``, ``debug``, ``export``, ``dump_config``, ``fusion_config``)."""

    GROUPS = ("experimental_config", "debug", "export", "dump_config", "fusion_config")

    def __init__(self):
        for group in self.GROUPS:
            setattr(self, group, _Options(group))


def get_npu_backend(*, compiler_config: CompilerConfig | None = None) -> str:
    """torchair.get_npu_backend: the backend for ``torch.compile``; here ``"inductor"``.

    Raises NotImplementedError naming an option whose effect the CPU path does not reproduce.
    """
    for group in CompilerConfig.GROUPS if compiler_config is not None else ():
        for option in getattr(compiler_config, group)._set:
            if option not in HARMLESS_OPTIONS.get(group, ()):
                raise NotImplementedError(
                    f"torchair.get_npu_backend: CompilerConfig.{group}.{option} is not supported on the CPU "
                    f"(inductor) path; supported: {sorted(o for g in HARMLESS_OPTIONS.values() for o in g)}"
                )
    return "inductor"


#: the names of the ``torchair`` stand-in
NAMES = {"get_npu_backend": get_npu_backend}
#: the names of ``torchair.configs.compiler_config``
CONFIG_NAMES = {"CompilerConfig": CompilerConfig}
