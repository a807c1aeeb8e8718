"""Graph passes (on onnx-ir) that rewrite exported MoE graphs to use ``cann.moe`` ops."""
