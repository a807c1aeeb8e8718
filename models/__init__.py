"""Model builders and small example models (``moe_onnx.models``)."""

import os

#: the shipped 4-rank EP MoE layer (``rank{r}.onnx``), used by ``moe-onnx demo``
EP_LAYER_SMALL = os.path.join(os.path.dirname(__file__), "ep_layer_small")
