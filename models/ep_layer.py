"""The per-rank graph of an expert-parallel MoE layer, as an exporter emits it from a
Megatron-style AlltoAll dispatcher, in plain ONNX ops plus ``cann.moe::AllToAll``.

Per rank (N ranks, L local experts each, E = N*L global experts, expert e on rank e // L):

    router MatMul -> TopK(K) -> softmax over the K logits (probs [T, K])
    token permute by expert: stable sort of the T*K slots by expert (TopK on the ids)
    per-expert counts [E] -> [N, L]; AllToAll of the counts gives recv counts [N, L]
    AllToAll of the tokens: rows grouped by source rank, then local expert
    chunk sort to expert-major  (pattern "split_concat" or "gather_index", see below)
    L local SwiGLU experts; the inverse chunk sort; AllToAll back
    un-permute and the probs-weighted combine -> y [T, H]

Chunk-sort patterns (what ``moe_onnx.converters`` recognises):
    "split_concat": Split by the received counts + Concat in expert-major order, as
                    ``torch.split`` / ``torch.cat`` export; inverse likewise.
    "gather_index": a Gather by an index computed from the counts with standard ops
                    (chunk id per row, stable sort by local expert); inverse by ScatterND.
    "drop_pad":     capacity C per expert: each rank sends a zero-padded [E*C, H] buffer
                    (slots past C dropped) with ``com.microsoft::AllToAll``; the received
                    block is reshaped to [N, L, C, H] and transposed to expert-major
                    [L, N, C, H]; the experts run batched; inverse transpose, AllToAll back.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from moe_onnx.commands.cli import OneLineParser, whole_number
from moe_onnx.custom_ops import DOMAIN, OPSET_VERSION

PATTERNS = ("split_concat", "gather_index", "drop_pad")


@dataclass(frozen=True)
class LayerConfig:
    ranks: int = 4
    local_experts: int = 2
    top_k: int = 2
    hidden: int = 16
    ffn: int = 32
    tokens_per_rank: int = 8  # for example batches; the graph's T is symbolic
    capacity: int = 4  # rows per expert per sending rank, "drop_pad" pattern only

    @property
    def experts(self) -> int:
        return self.ranks * self.local_experts


@dataclass(frozen=True)
class LayerWeights:
    """All experts' weights; rank r holds experts r*L .. r*L + L - 1."""

    router: np.ndarray  # [H, E]
    gate: np.ndarray  # [E, H, F]
    up: np.ndarray  # [E, H, F]
    down: np.ndarray  # [E, F, H]


def make_weights(config: LayerConfig, seed: int = 0) -> LayerWeights:
    rng = np.random.default_rng(seed)
    h, f, e = config.hidden, config.ffn, config.experts

    def w(*shape, fan_in):
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

    return LayerWeights(w(h, e, fan_in=h), w(e, h, f, fan_in=h), w(e, h, f, fan_in=h), w(e, f, h, fan_in=f))


class _Graph:
    """A tiny builder: ``g.op(type, inputs, n_outputs, **attrs)`` returns output names."""

    def __init__(self, prefix: str):
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.prefix, self.count = prefix, 0

    def name(self, hint: str) -> str:
        self.count += 1
        return f"{hint}_{self.count}"

    def const(self, hint: str, value) -> str:
        name = self.name(hint)
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(
        self,
        op_type: str,
        inputs: list[str],
        outputs: int | list[str] = 1,
        domain: str = "",
        name: str | None = None,
        **attrs,
    ) -> list[str]:
        outs = [self.name(op_type.lower()) for _ in range(outputs)] if isinstance(outputs, int) else outputs
        self.nodes.append(
            helper.make_node(op_type, inputs, outs, name=name or self.name(op_type), domain=domain, **attrs)
        )
        return outs

    def one(self, op_type: str, inputs: list[str], **attrs) -> str:
        return self.op(op_type, inputs, 1, **attrs)[0]


def build_rank_model(
    config: LayerConfig, weights: LayerWeights, rank: int, pattern: str = "split_concat"
) -> onnx.ModelProto:
    """The ONNX model rank ``rank`` runs: input ``x [T, H]`` float32, output ``y [T, H]``."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")
    n, l, k, e = config.ranks, config.local_experts, config.top_k, config.experts
    g = _Graph(f"rank{rank}")
    local = slice(rank * l, (rank + 1) * l)

    # route: top-k experts and softmax-normalised probs per token
    logits = g.one("MatMul", ["x", g.const("router", weights.router)])
    topk_logits, topk_expert = g.op("TopK", [logits, g.const("k", np.array([k], np.int64))], 2, axis=-1)
    probs = g.one("Softmax", [topk_logits], axis=-1)

    # token permute by expert: stable sort of slots p = t*K + j by expert id
    slot_expert = g.one("Reshape", [topk_expert, g.const("flat", np.array([-1], np.int64))])
    num_slots = g.one("Shape", [slot_expert])
    _, sorted_slot = g.op("TopK", [slot_expert, num_slots], 2, axis=0, largest=0, sorted=1)
    token_of_row = g.one("Div", [sorted_slot, g.const("top_k", np.array(k, np.int64))])
    dispatched = g.one("Gather", ["x", token_of_row], axis=0)

    # per-expert counts [E]
    is_expert = g.one(
        "Equal",
        [
            g.one("Unsqueeze", [slot_expert, g.const("ax1", np.array([1], np.int64))]),
            g.const("expert_ids", np.arange(e, dtype=np.int64)),
        ],
    )
    tokens_per_expert = g.one(
        "ReduceSum",
        [g.one("Cast", [is_expert], to=TensorProto.INT64), g.const("ax0", np.array([0], np.int64))],
        keepdims=0,
    )
    if pattern == "drop_pad":
        by_slot = _drop_pad_experts(g, config, weights, local, slot_expert, sorted_slot, dispatched, tokens_per_expert)
        return _finish(g, config, rank, pattern, by_slot, probs)

    # [E] -> [N, L] -> exchanged: recv counts [N, L]
    counts_to_rank = g.one("Reshape", [tokens_per_expert, g.const("nl", np.array([n, l], np.int64))])
    send_counts = g.one("ReduceSum", [counts_to_rank, g.const("ax1", np.array([1], np.int64))], keepdims=0)
    recv_expert_counts, _ = g.op(
        "AllToAll", [counts_to_rank, g.const("ones", np.ones(n, np.int64))], 2, domain=DOMAIN, name="all_to_all_counts"
    )
    received, recv_counts = g.op("AllToAll", [dispatched, send_counts], 2, domain=DOMAIN, name="all_to_all_dispatch")

    # chunk sort: rank-major -> expert-major
    if pattern == "split_concat":
        expert_major = _split_concat(g, received, recv_expert_counts, n, l, to_expert_major=True)
    else:
        chunk_index = _expert_major_index(g, recv_expert_counts, l)
        expert_major = g.one("Gather", [received, chunk_index], axis=0)

    # L local SwiGLU experts
    rows_per_expert = g.one("ReduceSum", [recv_expert_counts, g.const("ax0", np.array([0], np.int64))], keepdims=0)
    expert_inputs = g.op("Split", [expert_major, rows_per_expert], l, axis=0) if l > 1 else [expert_major]
    expert_outputs = []
    for j, h in enumerate(expert_inputs):
        gate = g.one("MatMul", [h, g.const(f"w_gate{j}", weights.gate[local][j])])
        up = g.one("MatMul", [h, g.const(f"w_up{j}", weights.up[local][j])])
        act = g.one("Mul", [g.one("Mul", [gate, g.one("Sigmoid", [gate])]), up])
        expert_outputs.append(g.one("MatMul", [act, g.const(f"w_down{j}", weights.down[local][j])]))
    expert_out = g.one("Concat", expert_outputs, axis=0) if l > 1 else expert_outputs[0]

    # inverse chunk sort: expert-major -> rank-major
    if pattern == "split_concat":
        rank_major = _split_concat(g, expert_out, recv_expert_counts, n, l, to_expert_major=False)
    else:
        zeros = g.one(
            "ConstantOfShape",
            [g.one("Shape", [expert_out])],
            value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]),
        )
        rank_major = g.one(
            "ScatterND", [zeros, g.one("Unsqueeze", [chunk_index, g.const("ax1", np.array([1], np.int64))]), expert_out]
        )

    returned, _ = g.op("AllToAll", [rank_major, recv_counts], 2, domain=DOMAIN, name="all_to_all_combine")

    # un-permute: row d of the sorted order goes back to slot sorted_slot[d]
    zeros = g.one(
        "ConstantOfShape", [g.one("Shape", [returned])], value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])
    )
    by_slot = g.one(
        "ScatterND", [zeros, g.one("Unsqueeze", [sorted_slot, g.const("ax1", np.array([1], np.int64))]), returned]
    )
    return _finish(g, config, rank, pattern, by_slot, probs)


def _finish(g: _Graph, config: LayerConfig, rank: int, pattern: str, by_slot: str, probs: str) -> onnx.ModelProto:
    """The probs-weighted combine of ``by_slot [T*K, H]`` (slot p = t*K + j), and the model."""
    n, l, k = config.ranks, config.local_experts, config.top_k
    per_token = g.one("Reshape", [by_slot, g.const("tkh", np.array([-1, k, config.hidden], np.int64))])
    weighted = g.one("Mul", [per_token, g.one("Unsqueeze", [probs, g.const("ax2", np.array([2], np.int64))])])
    g.op("ReduceSum", [weighted, g.const("ax1", np.array([1], np.int64))], ["y"], keepdims=0)

    graph = helper.make_graph(
        g.nodes,
        f"ep_moe_layer_rank{rank}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", config.hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", config.hidden])],
        g.initializers,
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, OPSET_VERSION)]
    if pattern == "drop_pad":
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="moe_onnx.models.ep_layer")
    model.metadata_props.extend(
        [
            onnx.StringStringEntryProto(key=k_, value=str(v))
            for k_, v in (("ranks", n), ("rank", rank), ("local_experts", l), ("top_k", k), ("pattern", pattern))
        ]
    )
    return model


def _drop_pad_experts(
    g: _Graph,
    config: LayerConfig,
    weights: LayerWeights,
    local: slice,
    slot_expert: str,
    sorted_slot: str,
    dispatched: str,
    tokens_per_expert: str,
) -> str:
    """Capacity dispatch; returns the expert output of every slot ``[T*K, H]`` (0 if dropped).

    Sorted row d (expert e = sorted_expert[d]) sits at position d - start[e] of its expert;
    it is kept if that is < C, in buffer row e*C + position. Buffer row b = e*C + c takes
    sorted row start[e] + c if c < tokens_per_expert[e], else a zero row.
    """
    n, l, c, e, h = config.ranks, config.local_experts, config.capacity, config.experts, config.hidden

    def const(hint, value):
        return g.const(hint, np.array(value, np.int64))

    start = g.one("CumSum", [tokens_per_expert, const("axis0", 0)], exclusive=1)
    zero_row = g.const("zero_row", np.zeros((1, h), np.float32))
    num_rows = g.one("Squeeze", [g.one("Shape", [slot_expert]), const("ax0", [0])])
    buffer_expert = const("buffer_expert", np.repeat(np.arange(e), c))  # e of buffer row b
    buffer_pos = const("buffer_pos", np.tile(np.arange(c), e))  # c of buffer row b
    filled = g.one("Less", [buffer_pos, g.one("Gather", [tokens_per_expert, buffer_expert], axis=0)])
    source = g.one(
        "Where", [filled, g.one("Add", [g.one("Gather", [start, buffer_expert], axis=0), buffer_pos]), num_rows]
    )
    send = g.one("Gather", [g.one("Concat", [dispatched, zero_row], axis=0), source], axis=0)  # [E*C, H]

    (received,) = g.op("AllToAll", [send], 1, domain="com.microsoft", name="all_to_all_dispatch", group_size=n)
    grid = g.one("Reshape", [received, const("nlch", [n, l, c, h])])
    expert_major = g.one("Transpose", [grid], perm=[1, 0, 2, 3])  # [L, N, C, H]
    rows = g.one("Reshape", [expert_major, const("l_nc_h", [l, n * c, h])])
    gate = g.one("MatMul", [rows, g.const("w_gate", weights.gate[local])])
    up = g.one("MatMul", [rows, g.const("w_up", weights.up[local])])
    act = g.one("Mul", [g.one("Mul", [gate, g.one("Sigmoid", [gate])]), up])
    out = g.one("MatMul", [act, g.const("w_down", weights.down[local])])  # [L, N*C, H]
    back = g.one("Transpose", [g.one("Reshape", [out, const("lnch", [l, n, c, h])])], perm=[1, 0, 2, 3])
    (returned,) = g.op(
        "AllToAll",
        [g.one("Reshape", [back, const("rows_h", [-1, h])])],
        1,
        domain="com.microsoft",
        name="all_to_all_combine",
        group_size=n,
    )

    sorted_expert = g.one("Gather", [slot_expert, sorted_slot], axis=0)
    position = g.one(
        "Sub",
        [
            g.one("Range", [const("zero", 0), num_rows, const("one", 1)]),
            g.one("Gather", [start, sorted_expert], axis=0),
        ],
    )
    kept = g.one("Less", [position, const("capacity", c)])
    buffer_row = g.one(
        "Where",
        [kept, g.one("Add", [g.one("Mul", [sorted_expert, const("capacity", c)]), position]), const("dump", e * c)],
    )
    per_sorted = g.one("Gather", [g.one("Concat", [returned, zero_row], axis=0), buffer_row], axis=0)
    zeros = g.one(
        "ConstantOfShape",
        [g.one("Shape", [per_sorted])],
        value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]),
    )
    return g.one("ScatterND", [zeros, g.one("Unsqueeze", [sorted_slot, const("ax1", [1])]), per_sorted])


def _split_concat(g: _Graph, rows: str, recv_expert_counts: str, n: int, l: int, to_expert_major: bool) -> str:
    """``torch.split`` by chunk sizes + ``torch.cat`` in the other order.

    rank-major chunk (r, e) has ``recv_expert_counts[r, e]`` rows; expert-major order lists
    chunk (r, e) at position e*N + r.
    """
    if to_expert_major:
        sizes = g.one("Reshape", [recv_expert_counts, g.const("flat", np.array([-1], np.int64))])
        chunks = g.op("Split", [rows, sizes], n * l, axis=0)  # chunk r*L + e
        order = [r * l + e for e in range(l) for r in range(n)]
    else:
        sizes = g.one(
            "Reshape",
            [g.one("Transpose", [recv_expert_counts], perm=[1, 0]), g.const("flat", np.array([-1], np.int64))],
        )
        chunks = g.op("Split", [rows, sizes], n * l, axis=0)  # chunk e*N + r
        order = [e * n + r for r in range(n) for e in range(l)]
    return g.one("Concat", [chunks[i] for i in order], axis=0)


def _expert_major_index(g: _Graph, recv_expert_counts: str, l: int) -> str:
    """Gather index ``[R]`` (expert-major row -> rank-major row) from the counts, standard ops.

    Row i of the rank-major block belongs to chunk c(i) = #{chunk ends <= i}; its local
    expert is c(i) mod L; a stable sort by that expert (TopK breaks ties by lower index) is
    the gather index.
    """
    sizes = g.one("Reshape", [recv_expert_counts, g.const("flat", np.array([-1], np.int64))])
    ends = g.one("CumSum", [sizes, g.const("axis0", np.array(0, np.int64))])
    total = g.one("ReduceSum", [sizes], keepdims=1)
    rows = g.one(
        "Range",
        [
            g.const("zero", np.array(0, np.int64)),
            g.one("Squeeze", [total, g.const("ax0", np.array([0], np.int64))]),
            g.const("one", np.array(1, np.int64)),
        ],
    )
    passed = g.one(
        "LessOrEqual",
        [
            g.one("Unsqueeze", [ends, g.const("ax0", np.array([0], np.int64))]),
            g.one("Unsqueeze", [rows, g.const("ax1", np.array([1], np.int64))]),
        ],
    )
    chunk = g.one(
        "ReduceSum",
        [g.one("Cast", [passed], to=TensorProto.INT64), g.const("ax1", np.array([1], np.int64))],
        keepdims=0,
    )
    local_expert = g.one("Mod", [chunk, g.const("L", np.array(l, np.int64))])
    _, index = g.op("TopK", [local_expert, total], 2, axis=0, largest=0, sorted=1)
    return index


def dense_reference(
    config: LayerConfig, weights: LayerWeights, x: np.ndarray, capacity: int | None = None
) -> np.ndarray:
    """The whole layer in float64 numpy, all tokens against all experts: ``x [T, H] -> [T, H]``.

    With ``capacity``, each expert keeps the first C of this rank's slots p = t*K + j routed
    to it (in slot order) and the rest contribute nothing, as in the "drop_pad" layout.
    """
    x64 = x.astype(np.float64)
    logits = x64 @ weights.router.astype(np.float64)
    # descending, ties to the lower expert id (ONNX TopK's tie-break)
    topk = np.argsort(-logits, axis=1, kind="stable")[:, : config.top_k]
    top_logits = np.take_along_axis(logits, topk, axis=1)
    probs = np.exp(top_logits - top_logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    seen = np.zeros(config.experts, np.int64)
    y = np.zeros_like(x64)
    for t in range(len(x64)):
        for j, e in enumerate(topk[t]):
            seen[e] += 1
            if capacity is not None and seen[e] > capacity:
                continue
            gate = x64[t] @ weights.gate[e]
            up = x64[t] @ weights.up[e]
            y[t] += probs[t, j] * ((gate / (1 + np.exp(-gate)) * up) @ weights.down[e])
    return y


def example_inputs(config: LayerConfig, seed: int = 0) -> list[np.ndarray]:
    """One seeded batch ``x [T, H]`` float32 per rank."""
    rng = np.random.default_rng(seed + 1000)
    return [
        rng.standard_normal((config.tokens_per_rank, config.hidden)).astype(np.float32) for _ in range(config.ranks)
    ]


def write_models(directory: str, config: LayerConfig, seed: int = 0, pattern: str = "split_concat") -> list[str]:
    """Write ``rank{r}.onnx`` for every rank; returns the paths."""
    os.makedirs(directory, exist_ok=True)
    weights = make_weights(config, seed)
    paths = []
    for r in range(config.ranks):
        path = os.path.join(directory, f"rank{r}.onnx")
        onnx.save(build_rank_model(config, weights, r, pattern), path)
        paths.append(path)
    return paths


def parser() -> argparse.ArgumentParser:
    defaults = LayerConfig()
    p = OneLineParser(
        prog="python -m moe_onnx.models.ep_layer",
        description="Write OUT/rank{r}.onnx: one expert-parallel MoE layer per rank, in plain ONNX ops plus "
        "cann.moe::AllToAll, as an exporter gives it (docs/running.md#the-example-layer).",
    )
    p.add_argument("out", metavar="OUT", help="folder for rank{r}.onnx (made if missing; not an existing file)")
    p.add_argument("--ranks", type=whole_number(1), default=defaults.ranks, help="number of ranks N (default 4)")
    p.add_argument(
        "--local-experts", type=whole_number(1), default=defaults.local_experts, help="experts per rank L (default 2)"
    )
    p.add_argument(
        "--top-k", type=whole_number(1), default=defaults.top_k, help="experts per token K, at most N*L (default 2)"
    )
    p.add_argument("--hidden", type=whole_number(1), default=defaults.hidden, help="hidden size H (default 16)")
    p.add_argument("--ffn", type=whole_number(1), default=defaults.ffn, help="experts' inner size F (default 32)")
    p.add_argument(
        "--pattern",
        choices=PATTERNS,
        default="split_concat",
        help="how the chunk sort after the AllToAll is written (module doc; default split_concat)",
    )
    p.add_argument("--seed", type=whole_number(0), default=0, help="seed of the weights (default 0)")
    return p


def main(argv=None) -> int:
    """The command; every option is checked before anything is written."""
    p = parser()
    a = p.parse_args(argv)
    config = LayerConfig(a.ranks, a.local_experts, a.top_k, a.hidden, a.ffn)
    if a.top_k > config.experts:
        p.error(f"--top-k {a.top_k} is more than the {config.experts} experts (--ranks x --local-experts)")
    if os.path.lexists(a.out) and not os.path.isdir(a.out):
        p.error(f"OUT {a.out} exists and is not a folder")
    for path in write_models(a.out, config, a.seed, a.pattern):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
