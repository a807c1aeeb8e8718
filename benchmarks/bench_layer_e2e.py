"""The whole MoE layer, every way it can run here, side by side in one process (issue 31):

    python -m moe_onnx.benchmarks.bench_layer_e2e [mixtral|qwen3|deepseek|tiny ...] [--tokens 1,16]
    moe-onnx bench --layer [NAME]

A layer is softmax top-k gating -> dispatch -> GroupedMatmul [gate | up] -> SwiGlu ->
GroupedMatmul down -> combine, float32, the same weights and tokens each way::

    MoeGatingTopKSoftmax(logits [T, E], k=K) -> probs [T, K], ids [T, K]
    MoeInitRoutingV3(x [T, H], ids, count flag) -> rows [T*K, H], row_idx [T*K], counts [E]
    GroupedMatmul(rows, w13 [E, 2I, H], counts, transpose_weight=1) -> [T*K, 2I]
    SwiGlu -> [T*K, I];  GroupedMatmul(., w2 [E, H, I], counts, transpose_weight=1) -> [T*K, H]
    MoeFinalizeRoutingV2(., row_idx, scales=probs, drop_pad_mode=2) -> y [T, H]

The weights are the checkpoint layout (``[out, in]`` per expert), which is also what
``com.microsoft::MoE`` takes (``fc1 [E, 2I, H]`` with ``swiglu_fusion=2``, ``fc2 [E, H, I]``),
so every path reads the same arrays. The paths, run in turn round after round (medians; each
ratio the median of its per-round ratios to onnxruntime's MoE):

* ``session``: ``moe_onnx.InferenceSession`` (split executor) on the six-node model;
* ``session bf16``: the same model with bfloat16 x, logits and weights;
* ``onnxruntime MoE``: ``com.microsoft::MoE`` (onnxruntime's fused CPU kernel, float32 only);
* ``lowered``: stock onnxruntime on ``moe_onnx.lower(model, inline=True)`` of the model with
  its weights as initializers, as an export holds them (one packed ``Gemm`` weight per expert;
  a copy of its own, which no other path warms in the caches);
* ``lowered, weights fed``: the same on the model whose weights are graph inputs, fed the
  shared arrays (the ``Loop`` body, which gathers each hit expert's weight);
* ``torch eager``: the layer written with torch_npu's names on the stand-ins;
* ``weights floor``: the weight bytes of the experts hit, read once at the bandwidth of a copy
  (a numpy copy of half those bytes into a preallocated buffer: a copy moves twice its size;
  from one warm source, or with ``--initializers`` from sources spanning 1 GB in turn);
* ``GEMM floor``: one dense float32 matmul of the same FLOPs (numpy's BLAS, every core).

The two floors run in rounds of their own after the others' (numpy's multi-threaded GEMM leaves
OpenBLAS's workers busy-waiting, which slowed whatever ran next up to 3x). "floor" is the
weights floor at decode (T <= 16), the GEMM floor at prefill (T >= 512) and the larger of the
two in between. Times are medians; the machine may be shared, so read the
ratios (taken within a round) rather than the absolute times.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from moe_onnx.custom_ops import DOMAIN, OPSET_VERSION

from .harness import copy_floor, interleaved_seconds
from .presets import DEFAULT_LAYERS, LAYER_SHAPES, LayerShape

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOAT32 = np.dtype(np.float32)


#: decode (T <= 16) and prefill batch sizes
TOKENS = (1, 2, 4, 16, 64, 128, 512, 2048)


def layer_model(
    shape: LayerShape, dtype: np.dtype = FLOAT32, weights: dict[str, np.ndarray] | None = None
) -> onnx.ModelProto:
    """The six-node layer; inputs x [T, H], logits [T, E]; w13 [E, 2I, H], w2 [E, H, I]
    initializers (``weights`` cast to ``dtype``, as an exported model holds them) or, without
    ``weights``, graph inputs fed with every call."""
    h, i, e, k = shape.hidden, shape.inter, shape.experts, shape.top_k
    elem = helper.np_dtype_to_tensor_dtype(dtype) if dtype != BF16 else TensorProto.BFLOAT16

    def op(op_type, inputs, outputs, **attrs):
        return helper.make_node(op_type, inputs, outputs, domain=DOMAIN, name=op_type + "_" + outputs[0], **attrs)

    nodes = [
        op("MoeGatingTopKSoftmax", ["logits"], ["probs", "ids", "gating_rows"], k=k),
        op(
            "MoeInitRoutingV3",
            ["x", "ids"],
            ["rows", "row_idx", "counts"],
            active_num=-1,
            expert_num=e,
            expert_tokens_num_type=1,
            expert_tokens_num_flag=1,
        ),
        op(
            "GroupedMatmul",
            ["rows", "w13", "", "counts"],
            ["gate_up"],
            group_type=0,
            group_list_type=1,
            transpose_weight=1,
        ),
        op("SwiGlu", ["gate_up"], ["act"]),
        op("GroupedMatmul", ["act", "w2", "", "counts"], ["down"], group_type=0, group_list_type=1, transpose_weight=1),
        op("MoeFinalizeRoutingV2", ["down", "row_idx", "", "", "", "probs"], ["y"], drop_pad_mode=2),
    ]
    graph = helper.make_graph(
        nodes,
        f"moe_layer_{shape.name}",
        [
            helper.make_tensor_value_info("x", elem, ["T", h]),
            helper.make_tensor_value_info("logits", elem, ["T", e]),
            helper.make_tensor_value_info("w13", elem, [e, 2 * i, h]),
            helper.make_tensor_value_info("w2", elem, [e, h, i]),
        ],
        [helper.make_tensor_value_info("y", elem, ["T", h])],
    )
    if weights is not None:
        constant_inputs(graph, {name: weights[name].astype(dtype) for name in ("w13", "w2")})
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, OPSET_VERSION)]
    )


def constant_inputs(graph: onnx.GraphProto, arrays: dict[str, np.ndarray]) -> None:
    """The graph inputs named in ``arrays`` become initializers holding them."""
    kept = [value for value in graph.input if value.name not in arrays]
    del graph.input[:]
    graph.input.extend(kept)
    graph.initializer.extend(numpy_helper.from_array(array, name) for name, array in arrays.items())


def ort_moe_model(
    shape: LayerShape, normalize: bool = False, fc1: np.ndarray | None = None, w2: np.ndarray | None = None
) -> onnx.ModelProto:
    """``com.microsoft::MoE`` computing the same layer: softmax top-k (renormalised over the
    top-k when ``normalize``: bench_transformers' Mixtral and Qwen3 blocks),
    SwiGLU ``silu(gate) * up`` (alpha 1, beta 0). Its CPU kernel takes only interleaved gate/up
    rows (swiglu_fusion 1): ``fc1 [E, 2I, H]`` is :func:`interleaved` w13, made once, as a
    loader would lay out a checkpoint for it."""
    h, i, e = shape.hidden, shape.inter, shape.experts
    node = helper.make_node(
        "MoE",
        ["x", "logits", "fc1", "", "w2"],
        ["y"],
        domain="com.microsoft",
        k=shape.top_k,
        activation_type="swiglu",
        swiglu_fusion=1,
        activation_alpha=1.0,
        activation_beta=0.0,
        normalize_routing_weights=int(normalize),
    )
    graph = helper.make_graph(
        [node],
        "ort_moe",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", h]),
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", e]),
            helper.make_tensor_value_info("fc1", TensorProto.FLOAT, [e, 2 * i, h]),
            helper.make_tensor_value_info("w2", TensorProto.FLOAT, [e, h, i]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", h])],
    )
    if fc1 is not None and w2 is not None:  # initializers instead of inputs
        constant_inputs(graph, {"fc1": fc1, "w2": w2})
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )


def layer_weights(shape: LayerShape, seed: int = 0) -> dict[str, np.ndarray]:
    """w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], float32, checkpoint layout."""
    rng = np.random.default_rng(seed)
    h, i, e = shape.hidden, shape.inter, shape.experts
    return {
        "w13": (rng.standard_normal((e, 2 * i, h), np.float32) / np.float32(h**0.5)),
        "w2": (rng.standard_normal((e, h, i), np.float32) / np.float32(i**0.5)),
    }


def layer_tokens(shape: LayerShape, tokens: int, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed * 7919 + tokens)
    return {
        "x": rng.standard_normal((tokens, shape.hidden), np.float32),
        "logits": rng.standard_normal((tokens, shape.experts), np.float32),
    }


def interleaved(w13: np.ndarray) -> np.ndarray:
    """``[E, 2I, H]`` gate row j at 2j, up row j at 2j + 1 (w13 holds the gate rows, then the up rows)."""
    e, two_i, h = w13.shape
    return np.ascontiguousarray(w13.reshape(e, 2, two_i // 2, h).transpose(0, 2, 1, 3).reshape(e, two_i, h))


def hit_experts(shape: LayerShape, logits: np.ndarray) -> int:
    """How many experts the top-K of ``logits`` picks at least once."""
    top = np.argsort(-logits, axis=1, kind="stable")[:, : shape.top_k]
    return len(np.unique(top))


def torch_layer(shape: LayerShape, weights: dict[str, np.ndarray]) -> Callable:
    """The layer with torch_npu's names (the stand-ins), weights as FusedMoEGMM holds them
    (``[E, H, 2I]`` / ``[E, I, H]`` transposed views of the checkpoint layout)."""
    import torch

    from moe_onnx.torch.stand_ins import install_stand_ins

    torch_npu = install_stand_ins()["torch_npu"]
    w13 = torch.from_numpy(weights["w13"]).transpose(1, 2)
    w2 = torch.from_numpy(weights["w2"]).transpose(1, 2)
    e, k = shape.experts, shape.top_k

    def run(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        probs, ids, _ = torch_npu.npu_moe_gating_top_k_softmax(logits, None, k=k)
        rows, row_idx, counts, _ = torch_npu.npu_moe_init_routing_v2(
            x,
            ids,
            active_num=ids.numel(),
            expert_num=e,
            expert_tokens_num_type=1,
            expert_tokens_num_flag=True,
            active_expert_range=[0, e],
            quant_mode=-1,
        )
        h = torch_npu.npu_grouped_matmul(
            [rows], [w13], group_list=counts, group_type=0, group_list_type=1, split_item=3
        )
        act = torch_npu.npu_swiglu(h[0])
        down = torch_npu.npu_grouped_matmul(
            [act], [w2], group_list=counts, group_type=0, group_list_type=1, split_item=3
        )
        return torch_npu.npu_moe_finalize_routing(
            down[0],
            skip1=None,
            skip2=None,
            bias=None,
            scales=probs,
            expanded_src_to_dst_row=row_idx,
            export_for_source_row=None,
            drop_pad_mode=2,
        )

    return run


class LayerBench:
    """The sessions of one layer shape (built once, reused for every T).

    By default the paths read the same weight arrays, fed with every call, except ``lowered``:
    the model as an export holds it, the weights as initializers (one packed ``Gemm`` weight
    per expert once lowered), so it reads a copy of its own that no other path warms in the
    caches; ``lowered, weights fed`` is the lowered model fed the shared arrays. With
    ``initializers`` every model holds its weights (each path reads its own copy, as in a
    deployed model, where a layer's weights are not in the caches from another layer's call),
    and ``lowered, weights fed`` is left out."""

    def __init__(self, shape: LayerShape, with_torch: bool = True, initializers: bool = False):
        import onnxruntime as ort

        import moe_onnx
        from moe_onnx.runtime.ort_session import without_spinning

        self.shape = shape
        self.weights = layer_weights(shape)
        self.initializers = initializers
        held = self.weights if initializers else None
        self.fc1 = interleaved(self.weights["w13"])
        self.weights_bf16 = {name: w.astype(BF16) for name, w in self.weights.items()}
        model = layer_model(shape, weights=held)
        self.session = moe_onnx.InferenceSession(model)
        self.session_bf16 = moe_onnx.InferenceSession(layer_model(shape, BF16, held))
        # idle onnxruntime workers spinning after a call would take the cores of the next path
        quiet = without_spinning(ort.SessionOptions())
        quiet.log_severity_level = 3  # the lowered model leaves unused constants, which onnxruntime lists
        cpu = ["CPUExecutionProvider"]

        def stock(proto: onnx.ModelProto) -> ort.InferenceSession:
            return ort.InferenceSession(proto.SerializeToString(), quiet, providers=cpu)

        if initializers:
            self.ort_moe = stock(ort_moe_model(shape, fc1=self.fc1, w2=self.weights["w2"]))
        else:
            self.ort_moe = stock(ort_moe_model(shape))
        self.lowered = stock(moe_onnx.lower(layer_model(shape, weights=self.weights), inline=True))
        self.lowered_fed = None if initializers else stock(moe_onnx.lower(model, inline=True))
        self.torch = torch_layer(shape, self.weights) if with_torch else None
        s = shape
        self.dense = np.random.default_rng(2).standard_normal((s.hidden, 3 * s.inter), np.float32)

    def feeds(self, tokens: int) -> tuple[dict, dict, dict, dict]:
        """``(x and logits, the session's feeds, the bfloat16 session's, onnxruntime MoE's)``."""
        tokens_only = layer_tokens(self.shape, tokens)
        tokens_bf16 = {name: v.astype(BF16) for name, v in tokens_only.items()}
        if self.initializers:
            return tokens_only, tokens_only, tokens_bf16, tokens_only
        feeds = {**tokens_only, **self.weights}
        return tokens_only, feeds, tokens_bf16 | self.weights_bf16, self.ort_feeds(feeds)

    def ort_feeds(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """onnxruntime's MoE's feeds from the session's (weights fed): fc1 for w13."""
        return {"x": feeds["x"], "logits": feeds["logits"], "fc1": self.fc1, "w2": feeds["w2"]}

    def paths(self, tokens: int) -> tuple[dict[str, Callable], dict]:
        """The timed callables at ``tokens`` and what the row reports besides times."""
        s = self.shape
        tokens_only, feeds, feeds_bf16, ort_feeds = self.feeds(tokens)
        hit = hit_experts(s, tokens_only["logits"])
        weight_bytes = hit * s.weight_bytes_per_expert()
        a = np.random.default_rng(3).standard_normal((tokens * s.top_k, s.hidden), np.float32)
        dense, out = self.dense, np.empty((tokens * s.top_k, 3 * s.inter), np.float32)
        paths: dict[str, Callable] = {
            "onnxruntime MoE": lambda: self.ort_moe.run(None, ort_feeds),
            "session": lambda: self.session.run(None, feeds),
            "session bf16": lambda: self.session_bf16.run(None, feeds_bf16),
            "lowered": lambda: self.lowered.run(None, tokens_only),
            # from memory where every path reads its own weights, from the caches where they share
            "weights floor": copy_floor(weight_bytes // 2, cold=self.initializers),
            "GEMM floor": lambda: np.matmul(a, dense, out=out),
        }
        if (lowered_fed := self.lowered_fed) is not None:
            paths["lowered, weights fed"] = lambda: lowered_fed.run(None, feeds)  # (the fed arrays: no initializers)
        if (torch_run := self.torch) is not None:
            import torch

            tx, tl = torch.from_numpy(tokens_only["x"]), torch.from_numpy(tokens_only["logits"])
            paths["torch eager"] = lambda: torch_run(tx, tl)
        info = {
            "weights": "initializers" if self.initializers else "fed",
            "hit_experts": hit,
            "weight_bytes": weight_bytes,
            "flops": 2 * tokens * s.top_k * 3 * s.hidden * s.inter,
        }
        return paths, info

    def check(self, tokens: int) -> dict[str, float]:
        """Largest difference of each path's y from the session's, relative to its largest value."""
        tokens_only, feeds, _, ort_feeds = self.feeds(tokens)
        want = self.session.run(None, feeds)[0]
        scale = float(np.abs(want).max()) or 1.0
        got = {
            "onnxruntime MoE": self.ort_moe.run(None, ort_feeds)[0],
            "lowered": self.lowered.run(None, tokens_only)[0],
        }
        if self.lowered_fed is not None:
            got["lowered, weights fed"] = self.lowered_fed.run(None, feeds)[0]
        if (torch_run := self.torch) is not None:
            import torch

            got["torch eager"] = torch_run(
                torch.from_numpy(tokens_only["x"]), torch.from_numpy(tokens_only["logits"])
            ).numpy()
        return {name: float(np.abs(y - want).max()) / scale for name, y in got.items()}


#: batch sizes read as decode (the weights floor) and as prefill (the GEMM floor); between them the larger
DECODE_MAX_TOKENS, PREFILL_MIN_TOKENS = 16, 512


def decode_or_prefill_floor(tokens: int, weights: float, gemm: float) -> float:
    """The floor of a layer call: reading the hit experts' weights at decode, the dense GEMM at
    prefill, the larger of the two in between (at decode the GEMM floor is one small product
    whose time on a shared machine is mostly waiting for a core)."""
    if tokens <= DECODE_MAX_TOKENS:
        return weights
    if tokens >= PREFILL_MIN_TOKENS:
        return gemm
    return max(weights, gemm)


def measure(bench: LayerBench, tokens: int, repeats: int) -> dict:
    """One row: medians of every path and their ratios to onnxruntime's MoE and to the floor."""
    paths, info = bench.paths(tokens)
    # the floors in rounds of their own, after the paths': numpy's multi-threaded GEMM leaves
    # OpenBLAS's workers busy-waiting for a while, which took a core from whatever ran next
    # (qwen3-like T = 4: session 3.4 -> 11.3 ms, onnxruntime's MoE 3.7 -> 10.3 ms)
    floors = {name: paths.pop(name) for name in FLOORS}
    seconds, to_ort = interleaved_seconds(paths, repeats)
    seconds |= interleaved_seconds(floors, repeats)[0]
    floor = decode_or_prefill_floor(tokens, seconds["weights floor"], seconds["GEMM floor"])
    row = {"layer": bench.shape.name, "tokens": tokens, **info, "floor_s": floor}
    row |= {f"{name} s": value for name, value in seconds.items()}
    row |= {f"{name} / onnxruntime MoE": value for name, value in to_ort.items()}
    row["session / floor"] = seconds["session"] / floor
    row["lowered / session"] = seconds["lowered"] / seconds["session"]
    if "lowered, weights fed" in seconds:
        row["lowered, weights fed / session"] = seconds["lowered, weights fed"] / seconds["session"]
    row["max relative difference"] = bench.check(tokens)
    return row


COLUMNS = (
    "session",
    "session bf16",
    "onnxruntime MoE",
    "lowered",
    "lowered, weights fed",
    "torch eager",
    "weights floor",
    "GEMM floor",
)
#: the paths that are costs to compare with, not ways to run the layer
FLOORS = ("weights floor", "GEMM floor")


def markdown_table(rows: list[dict]) -> str:
    """ms of every path, and session / onnxruntime MoE, session / floor, lowered / session."""
    head = (
        "| layer | T | hit | "
        + " | ".join(f"{c} ms" for c in COLUMNS)
        + " | session / ort MoE | bf16 session / ort MoE | session / floor | lowered / session"
        + " | lowered, weights fed / session |\n"
        + "|---|---:|---:|"
        + "---:|" * (len(COLUMNS) + 5)
    )
    lines = []
    for r in rows:
        times = " | ".join(f"{r[f'{c} s'] * 1e3:.2f}" if f"{c} s" in r else "-" for c in COLUMNS)
        lines.append(
            f"| {r['layer']} | {r['tokens']} | {r['hit_experts']} | {times} | "
            f"{r['session / onnxruntime MoE']:.2f} | {r['session bf16 / onnxruntime MoE']:.2f} | "
            f"{r['session / floor']:.2f} | {r['lowered / session']:.2f} | "
            + (f"{r['lowered, weights fed / session']:.2f} |" if "lowered, weights fed / session" in r else "- |")
        )
    return head + "\n" + "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """session, onnxruntime MoE, lowered, torch and the floor against T, one panel per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(dict.fromkeys(r["layer"] for r in rows))
    fig, axes = plt.subplots(1, len(layers), figsize=(5 * len(layers), 4), squeeze=False)
    for ax, layer in zip(axes[0], layers):
        mine = [r for r in rows if r["layer"] == layer]
        ts = [r["tokens"] for r in mine]
        for name in ("session", "session bf16", "onnxruntime MoE", "lowered", "lowered, weights fed", "torch eager"):
            if f"{name} s" in mine[0]:
                ax.plot(ts, [r[f"{name} s"] * 1e3 for r in mine], marker="o", label=name)
        ax.plot(ts, [r["floor_s"] * 1e3 for r in mine], "k--", label="floor")
        ax.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="ms per layer call", title=layer)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def run(
    layers: tuple[str, ...] = DEFAULT_LAYERS,
    tokens: tuple[int, ...] = TOKENS,
    repeats: int = 5,
    with_torch: bool = True,
    echo=print,
    initializers: bool = False,
) -> list[dict]:
    rows = []
    for name in layers:
        bench = LayerBench(LAYER_SHAPES[name], with_torch=with_torch, initializers=initializers)
        for t in tokens:
            row = measure(bench, t, repeats)
            rows.append(row)
            echo(
                f"{name} T={t}: session {row['session s'] * 1e3:.2f} ms, onnxruntime MoE "
                f"{row['onnxruntime MoE s'] * 1e3:.2f} ms (session / MoE {row['session / onnxruntime MoE']:.2f}, "
                f"bf16 {row['session bf16 / onnxruntime MoE']:.2f}), floor {row['floor_s'] * 1e3:.2f} ms "
                f"(session / floor {row['session / floor']:.2f}), lowered / session {row['lowered / session']:.2f}; "
                + "max |y - session's| / max |y|: "
                + ", ".join(f"{k} {v:.1e}" for k, v in row["max relative difference"].items()),
                flush=True,
            )
        del bench
    return rows


def command(
    layer: str,
    repeats: int,
    json_path: str | None = None,
    markdown_path: str | None = None,
    plot_path: str | None = None,
    tokens: tuple[int, ...] = TOKENS,
    echo=print,
) -> int:
    """``moe-onnx bench --layer [NAME]``: every path of the layer at every T; the table printed
    and written to the files asked for."""
    from moe_onnx.ranks.rank_files import check_output_file

    from .suite import check_plot_path

    for path, option in ((json_path, "--json"), (markdown_path, "--markdown"), (plot_path, "--plot")):
        if path:
            check_output_file(path, option)
    if plot_path:
        check_plot_path(plot_path)
    layers = DEFAULT_LAYERS if layer == "all" else (layer,)
    echo(f"bench --layer: {', '.join(layers)} at T = {', '.join(map(str, tokens))}, {repeats} round(s)", flush=True)
    rows = run(layers, tokens, repeats, echo=echo)
    table = markdown_table(rows)
    echo(table)
    write_outputs(rows, json_path, markdown_path, plot_path)
    return 0


def write_outputs(rows: list[dict], json_path: str | None, markdown_path: str | None, plot_path: str | None) -> None:
    """The rows as JSON, the table as markdown and the plot, where a path is given."""
    from moe_onnx.ranks.rank_files import make_parent

    for path in (json_path, markdown_path, plot_path):
        if path:
            make_parent(path)
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
    if markdown_path:
        Path(markdown_path).write_text(markdown_table(rows) + "\n")
    if plot_path:
        plot(rows, plot_path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "layers", nargs="*", metavar="LAYER", help=f"{', '.join(LAYER_SHAPES)} (default: {DEFAULT_LAYERS})"
    )
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    parser.add_argument("--plot")
    parser.add_argument(
        "--initializers",
        action="store_true",
        help="every model holds its weights (each path reads its own copy); default: fed, shared",
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.layers if name not in LAYER_SHAPES]
    if unknown:
        parser.error(f"unknown layer(s) {unknown}; choose from {list(LAYER_SHAPES)}")
    tokens = tuple(int(t) for t in args.tokens.split(","))
    rows = run(tuple(args.layers or DEFAULT_LAYERS), tokens, args.repeats, initializers=args.initializers)
    print(markdown_table(rows))
    write_outputs(rows, args.json, args.markdown, args.plot)


if __name__ == "__main__":
    main(sys.argv[1:])
