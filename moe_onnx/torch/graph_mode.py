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

#: options of TorchAir's CompilerConfig that do not change what a graph computes, by their path:
#: keep_inference_input_mutations keeps an input's in-place update in the graph, as inductor does
HARMLESS_OPTIONS = {"experimental_config.keep_inference_input_mutations"}


class _Options:
    """A group of TorchAir options at ``path`` (``experimental_config``, ``debug.graph_dump``):
    any option may be set, at any depth; each set records its dotted path in ``set_paths`` (one
    record per config), so :func:`get_npu_backend` sees every option, read or not."""

    def __init__(self, path: str, set_paths: dict):
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_set_paths", set_paths)
        object.__setattr__(self, "_groups", {})

    def __setattr__(self, name: str, value: Any) -> None:
        self._set_paths[f"{self._path}.{name}" if self._path else name] = value

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        path = f"{self._path}.{name}" if self._path else name
        if path in self._set_paths:
            return self._set_paths[path]
        # an option group TorchAir has (debug.graph_dump, aoe_config, ge_config, ...): made on use
        return self._groups.setdefault(name, _Options(path, self._set_paths))


class CompilerConfig(_Options):
    """torchair.configs.compiler_config.CompilerConfig on a CPU: options are set as real code
    sets them (``config.mode``, ``config.experimental_config.x``, ``config.debug.graph_dump.type``),
    and :func:`get_npu_backend` decides which it accepts."""

    def __init__(self):
        super().__init__("", {})


def get_npu_backend(*, compiler_config: CompilerConfig | None = None) -> str:
    """torchair.get_npu_backend: the backend for ``torch.compile``; here ``"inductor"``.

    Raises NotImplementedError naming an option whose effect the CPU path does not reproduce
    (every option set but :data:`HARMLESS_OPTIONS`, at any depth).
    """
    for option in compiler_config._set_paths if compiler_config is not None else ():
        if option not in HARMLESS_OPTIONS:
            raise NotImplementedError(
                f"torchair.get_npu_backend: CompilerConfig.{option} is not supported on the CPU "
                f"(inductor) path; supported: {sorted(HARMLESS_OPTIONS)}"
            )
    return "inductor"


#: the names of the ``torchair`` stand-in
NAMES = {"get_npu_backend": get_npu_backend}
#: the names of ``torchair.configs.compiler_config``
CONFIG_NAMES = {"CompilerConfig": CompilerConfig}
