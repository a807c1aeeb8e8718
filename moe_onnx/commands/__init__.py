"""The ``moe-onnx`` command (:mod:`.cli`) and what its subcommands do with files: demo, convert,
lower, shard, check. Importing this package loads nothing (``moe-onnx --help`` reads the parser
without the op library)."""
