"""moe-onnx: CANN's MoE routing operators as ONNX custom ops that run in onnxruntime.

``import moe_onnx`` registers every ``cann.moe`` schema with ``onnx.defs``.
"""

from .builders import single_node_model
from .converters import lower
from .custom_ops import DOMAIN, OPS, OPSET_VERSION, MoeOpError
from .prepare import prepare_for_ort
from .pyops import session_options
from .session import InferenceSession

__all__ = [
    "DOMAIN",
    "OPS",
    "OPSET_VERSION",
    "InferenceSession",
    "lower",
    "MoeOpError",
    "prepare_for_ort",
    "session_options",
    "single_node_model",
]
