"""The Ascend chips the opt-in target check knows (:mod:`.targets`), in a module that imports
nothing: ``moe-onnx check --help`` lists them without loading the op library."""

#: the chips, by the names ``moe-onnx check --target`` and :func:`.targets.check` take
TARGETS = ("ascend910b", "ascend910_93", "ascend950")
#: bytes of Unified Buffer per AI Vector core, as the tiling code receives it (docs/targets.md)
UB_SIZE = {"ascend910b": 192 * 1024, "ascend910_93": 192 * 1024, "ascend950": 248 * 1024}
