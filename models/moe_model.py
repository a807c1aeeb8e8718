"""A single-device MoE model of ``cann.moe`` chain layers, in the shape ``moe-onnx shard`` takes.

Each layer, on ``h [T, H]`` (float32 or bfloat16; T symbolic)::

    logits = h @ router                                   GroupedMatmul (group_type -1) [T, E]
    probs, expert_idx = MoeGatingTopKSoftmax(logits, k)   [T, K] each
    rows, row_idx, counts = MoeInitRoutingV2(h, expert_idx)   rows [T*K, H] sorted by expert,
                                                          row_idx [T*K]: slot t*K+j -> row,
                                                          counts [E] (count or cumsum)
    up = GroupedMatmul(rows, w13 [E, H, 2F], Cast(counts))    one product per expert
    out = GroupedMatmul(SwiGlu(up), w2 [E, F, H], Cast(counts))
    shared = SwiGlu(h @ shared_up [H, 2F]) @ shared_down [F, H]   (``shared_experts``)
    h' = MoeFinalizeRoutingV2(out, row_idx, x1=shared | h, x2=h | -, scales=probs)

so h' = h + shared(h) + sum_j probs[t, j] * expert_{idx[t, j]}(h[t]) (the residual rides on the
finalize's skip inputs: onnxruntime's CPU ops have no bfloat16 Add or MatMul). The model's input
is ``x [T, H]``, its output ``y [T, H]``, both of the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper

from moe_onnx.custom_ops import DOMAIN, OPSET_VERSION

DTYPES = {"float32": (np.float32, TensorProto.FLOAT), "bfloat16": (ml_dtypes.bfloat16, TensorProto.BFLOAT16)}


@dataclass(frozen=True)
class MoeModelConfig:
    layers: int = 2
    experts: int = 8
    top_k: int = 2
    hidden: int = 16
    ffn: int = 8  # per expert; the shared expert has the same width
    shared_experts: bool = True
    dtype: str = "float32"  # or "bfloat16"
    counts: str = "count"  # MoeInitRoutingV2's counts: "count" or "cumsum" (GroupedMatmul's group_list_type)
    seed: int = 0


def layer_weights(config: MoeModelConfig, layer: int) -> dict[str, np.ndarray]:
    """Layer ``layer``'s weights in the model's dtype: router [H, E], w13 [E, H, 2F] (gate
    columns, then up), w2 [E, F, H], and the shared expert's shared_up [H, 2F], shared_down [F, H]."""
    rng = np.random.default_rng([config.seed, layer])
    h, f, e = config.hidden, config.ffn, config.experts
    dtype = DTYPES[config.dtype][0]

    def w(*shape, fan_in):
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32).astype(dtype)

    weights = {"router": w(h, e, fan_in=h), "w13": w(e, h, 2 * f, fan_in=h), "w2": w(e, f, h, fan_in=f)}
    if config.shared_experts:
        weights |= {"shared_up": w(h, 2 * f, fan_in=h), "shared_down": w(f, h, fan_in=f)}
    return weights


def build_moe_model(config: MoeModelConfig) -> onnx.ModelProto:
    """The model: input ``x [T, H]``, output ``y [T, H]`` (see the module doc)."""
    if config.counts not in ("count", "cumsum"):
        raise ValueError(f"counts must be 'count' or 'cumsum', got {config.counts!r}")
    element = DTYPES[config.dtype][1]
    nodes: list[onnx.NodeProto] = []
    initializers: list[onnx.TensorProto] = []
    flag, list_type = (2, 1) if config.counts == "count" else (1, 0)

    def node(op: str, inputs: list[str], outputs: list[str], domain: str = DOMAIN, **attrs) -> list[str]:
        nodes.append(helper.make_node(op, inputs, outputs, name=outputs[0].split(":")[0], domain=domain, **attrs))
        return outputs

    def matmul(x: str, w: str, out: str) -> str:
        return node("GroupedMatmul", [x, w], [out], group_type=-1)[0]

    def experts(rows: str, w: str, group_list: str, out: str) -> str:
        """One product per expert: rows [A, K] sorted by expert, w [E, K, N] -> [A, N]."""
        return node("GroupedMatmul", [rows, w, "", group_list], [out], group_type=0, group_list_type=list_type)[0]

    h = "x"
    for layer in range(config.layers):
        p = f"layer{layer}"
        for name, array in layer_weights(config, layer).items():
            initializers.append(onnx.numpy_helper.from_array(array, f"{p}.{name}"))
        logits = matmul(h, f"{p}.router", f"{p}.router_logits")
        probs, expert_idx, _ = node(
            "MoeGatingTopKSoftmax", [logits], [f"{p}.probs", f"{p}.expert_idx", f"{p}.gating_row_idx"], k=config.top_k
        )
        rows, row_idx, counts = node(
            "MoeInitRoutingV2",
            [h, expert_idx],
            [f"{p}.routed_rows", f"{p}.expanded_row_idx", f"{p}.expert_counts"],
            expert_num=config.experts,
            expert_tokens_count_or_cumsum_flag=flag,
        )
        (group_list,) = node("Cast", [counts], [f"{p}.group_list"], domain="", to=TensorProto.INT64)

        act = node("SwiGlu", [experts(rows, f"{p}.w13", group_list, f"{p}.experts_up")], [f"{p}.experts_act"])[0]
        out = experts(act, f"{p}.w2", group_list, f"{p}.experts_out")
        skips = [h]
        if config.shared_experts:
            shared_up = matmul(h, f"{p}.shared_up", f"{p}.shared_up_out")
            (shared_act,) = node("SwiGlu", [shared_up], [f"{p}.shared_act"])
            skips = [matmul(shared_act, f"{p}.shared_down", f"{p}.shared_out"), h]
        last = layer == config.layers - 1
        inputs = [out, row_idx, *skips] + [""] * (2 - len(skips)) + ["", probs]
        (h,) = node("MoeFinalizeRoutingV2", inputs, ["y" if last else f"{p}.y"], drop_pad_mode=2)
    graph = helper.make_graph(
        nodes,
        "moe_model",
        [helper.make_tensor_value_info("x", element, ["T", config.hidden])],
        [helper.make_tensor_value_info("y", element, ["T", config.hidden])],
        initializers,
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, OPSET_VERSION)]
    return helper.make_model(graph, opset_imports=opsets, producer_name="moe_onnx.models.moe_model")
