"""The runtime: :class:`~moe_onnx.runtime.session.InferenceSession` and the executors behind it
(split, pyop, lowered), the onnxruntime(-extensions) boundary and the graph binding they share.
Public names are ``moe_onnx.InferenceSession``, ``moe_onnx.prepare_for_ort`` and
``moe_onnx.session_options``."""
