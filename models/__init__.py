"""Model builders and small example models (``moe_onnx.models``)."""

if __name__ != "moe_onnx.models":  # the repository root on sys.path would load a second copy
    raise ImportError(f"import this package as 'moe_onnx.models' (pip install -e .), not as {__name__!r}")

import os

#: the shipped 4-rank EP MoE layer (``rank{r}.onnx``), used by ``moe-onnx demo``
EP_LAYER_SMALL = os.path.join(os.path.dirname(__file__), "ep_layer_small")
