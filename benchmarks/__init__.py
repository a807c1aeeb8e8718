"""Benchmarks of the ops and converters (``moe_onnx.benchmarks``, ``moe-onnx bench``)."""

if __name__ != "moe_onnx.benchmarks":  # the repository root on sys.path would load a second copy
    raise ImportError(f"import this package as 'moe_onnx.benchmarks' (pip install -e .), not as {__name__!r}")
