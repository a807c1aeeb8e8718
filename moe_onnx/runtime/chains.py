"""Adjacent cann.moe nodes run as one step where a kernel computes them together.

One chain so far: an MoE layer's experts and combine, four nodes in a row, with the dispatch
before them and the gating before it when they are there::

    MoeGatingTopKSoftmax(logits) -> probs, ids               (optional, with the dispatch)
    MoeInitRoutingV3(x, ids) -> rows, row_idx, counts        (dropless; optional)
    GroupedMatmul(rows, w_gate_up, -, counts) -> gate_up     (group_type 0, transpose_weight 1)
    SwiGlu(gate_up) -> act                                    (dim -1)
    GroupedMatmul(act, w_down, -, counts) -> down            (the same attributes, the same counts)
    MoeFinalizeRoutingV2(down, row_idx, -, -, -, probs) -> y (drop_pad_mode 0 or 2)

At decode :mod:`moe_onnx.custom_ops.expert_chain` computes them in one compiled call with the
ops' bits. The step keeps the node steps: the first call at each input signature runs them
(inference and every static check, as always), and so does any call the chain kernel declines
(larger groups, values an op refuses: its error names its node). Every named output of the
nodes is produced either way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..custom_ops import expert_chain
from ..custom_ops.moe_gating_top_k_softmax import slot_rows
from ..custom_ops.opdef import max_bytes

#: the ops of the chain, in order; the dispatch before them is optional, and the gating before it
EXPERT_CHAIN = ("GroupedMatmul", "SwiGlu", "GroupedMatmul", "MoeFinalizeRoutingV2")
DISPATCH = "MoeInitRoutingV3"
GATING = "MoeGatingTopKSoftmax"
#: input signatures a step remembers as checked
KEEP = 16


class ExpertChainStep:
    """Node steps that :func:`match`: the chain's four, after the dispatch when there are five,
    after the gating and the dispatch when there are six."""

    def __init__(self, steps: list):
        self.steps = steps
        self.gating = steps[0].node if len(steps) == 6 else None
        self.dispatch = steps[-5].node if len(steps) >= 5 else None
        up, glu, down, combine = (step.node for step in steps[-4:])
        self.cumulative = up.attrs.get("group_list_type", 0) == 0
        self.drop_pad_mode = combine.attrs.get("drop_pad_mode", 0)
        chain_outputs = [up.outputs[0], glu.outputs[0], down.outputs[0], combine.outputs[0]]
        weights = [up.inputs[1], down.inputs[1]]
        if self.dispatch is None:  # in experts_and_combine's order
            self.external = [up.inputs[0], *weights, up.inputs[3], combine.inputs[1], combine.inputs[5]]
            self.produced = chain_outputs
        else:  # x, the weights, then ids and scales, or the logits
            self.active_num = self.dispatch.attrs.get("active_num", -1)
            self.external = [self.dispatch.inputs[0], *weights]
            if self.gating is None:
                self.external += [self.dispatch.inputs[1], combine.inputs[5]]
                self.produced = self.dispatch.outputs[:4] + chain_outputs
            else:
                self.top_k = self.gating.attrs.get("k", 1)  # (a node's attrs: the ones it sets)
                self.external += [self.gating.inputs[0]]
                self.produced = self.gating.outputs[:3] + self.dispatch.outputs[:4] + chain_outputs
        self._checked: dict[tuple, int] = {}  # input signature -> bytes of the outputs

    @property
    def inputs(self) -> list[str | None]:
        return [name for step in self.steps for name in step.inputs]

    def run(self, values: dict[str, np.ndarray], context: dict[str, Any], run_options) -> None:
        arrays = [values[name] for name in self.external]
        key = tuple((a.dtype, a.shape) for a in arrays)
        nbytes = self._checked.get(key)
        if nbytes is None or nbytes > max_bytes():  # the node steps check, infer and refuse
            self._run_steps(self.steps, values, context, run_options)
            if len(self._checked) < KEEP:
                self._checked[key] = sum(values[name].nbytes for name in self.produced if name)
            return
        if self.dispatch is None:
            rows, w_gate_up, w_down, counts, row_idx, scales = arrays
            chain = expert_chain.experts_and_combine(
                rows, w_gate_up, w_down, counts, self.cumulative, row_idx, scales, self.drop_pad_mode
            )
            if chain is None:
                self._run_steps(self.steps, values, context, run_options)
                return
            self._keep(self.produced, chain, values)
            return
        x, w_gate_up, w_down = arrays[:3]
        steps, produced, gated = self.steps, self.produced, self.gating is not None
        if gated and arrays[3].dtype not in expert_chain.GATED_LOGITS:  # the node gates
            steps[0].run(values, context, run_options)
            steps, produced, gated = steps[1:], produced[3:], False
            arrays[3:] = [values[self.gating.outputs[1]], values[self.gating.outputs[0]]]  # type: ignore
        if gated:
            slots = len(arrays[3]) * self.top_k
            routing: dict[str, Any] = {"logits": arrays[3], "top_k": self.top_k}
        else:
            slots = arrays[3].size
            routing = {"ids": arrays[3], "scales": arrays[4]}
        dispatched = None
        if self.active_num <= 0 or self.active_num >= slots:  # every slot a row
            dispatched = expert_chain.dispatch_experts_and_combine(
                x, w_gate_up, w_down, self.cumulative, self.drop_pad_mode, **routing
            )
        if dispatched is None:
            self._run_steps(steps, values, context, run_options)
            return
        if gated:
            probs, ids = dispatched.probs, dispatched.ids
            assert probs is not None and ids is not None
            self._keep(produced[:3], (probs, ids, slot_rows(len(ids), self.top_k)), values)
            produced = produced[3:]
        expanded_scale = np.zeros(len(dispatched.row_idx), np.float32)  # no scale input: zeros
        self._keep(produced[:4], (dispatched.rows, dispatched.row_idx, dispatched.counts, expanded_scale), values)
        if dispatched.chain is None:
            self._run_steps(self.steps[-4:], values, context, run_options)
        else:
            self._keep(produced[4:], dispatched.chain, values)

    @staticmethod
    def _run_steps(steps: list, values, context, run_options) -> None:
        for step in steps:
            step.run(values, context, run_options)

    @staticmethod
    def _keep(names: list[str | None], results, values: dict[str, np.ndarray]) -> None:
        for name, value in zip(names, results):
            if name:
                values[name] = value


def match(steps: list) -> bool:
    """Whether node steps are the chain: four (:func:`match_chain`), the dispatch and four
    (:func:`match_dispatch`), or the gating, the dispatch and four (:func:`match_gating`)."""
    if not steps or any(getattr(step, "node", None) is None for step in steps):
        return False
    nodes = [step.node for step in steps]
    if len(nodes) == 6:
        return match(steps[1:]) and match_gating(nodes[0], nodes[1], nodes[-1])
    if len(nodes) == 5:
        return match_chain(nodes[1:]) and match_dispatch(nodes[0], nodes[1:])
    return len(nodes) == 4 and match_chain(nodes)


def match_chain(nodes: list) -> bool:
    """The four nodes above: their ops and attributes, each reading the one before, both
    products grouped by the same counts, no bias, every output named."""
    if tuple(node.op.name for node in nodes) != EXPERT_CHAIN:
        return False
    up, glu, down, combine = nodes
    for gmm in (up, down):
        attrs = gmm.attrs
        if (
            attrs.get("group_type") != 0
            or attrs.get("transpose_weight", 0) != 1
            or attrs.get("transpose_x", 0) != 0
            or attrs.get("split_item", 3) not in (2, 3)
            or attrs.get("output_dtype") is not None
            or attrs.get("group_list_type", 0) != up.attrs.get("group_list_type", 0)
            or gmm.inputs[2] is not None
            or gmm.inputs[3] is None
            or any(name is not None for name in gmm.inputs[4:])
        ):
            return False
    if glu.attrs.get("dim", -1) not in (-1, 1):
        return False
    inputs = combine.inputs
    if combine.attrs.get("drop_pad_mode", 0) not in (0, 2) or any(inputs[i] is not None for i in (2, 3, 4, 6)):
        return False
    flows = (
        glu.inputs[0] == up.outputs[0],
        down.inputs[0] == glu.outputs[0],
        down.inputs[3] == up.inputs[3],
        inputs[0] == down.outputs[0],
        inputs[1] is not None and inputs[5] is not None,
    )
    return all(flows) and all(node.outputs[0] for node in nodes)


def match_dispatch(dispatch, chain: list) -> bool:
    """MoeInitRoutingV3 feeding the chain: dropless, no scale or offset, counts the products'
    kind (sizes or running sums), slot -> row indices, the whole expert range."""
    if dispatch.op.name != DISPATCH:
        return False
    up, _, down, combine = chain
    attrs = dispatch.attrs
    experts = attrs.get("expert_num", -1)
    expert_range = attrs.get("active_expert_range") or [0, experts]
    counts_kind = 0 if up.attrs.get("group_list_type", 0) == 0 else 1
    rows, row_idx, counts = dispatch.outputs[:3]
    return (
        attrs.get("drop_pad_mode", 0) == 0
        and attrs.get("quant_mode", -1) == -1
        and attrs.get("row_idx_type", 0) == 0
        and attrs.get("expert_tokens_num_flag", 0) == 1
        and attrs.get("expert_tokens_num_type", 0) == counts_kind
        and list(expert_range) == [0, experts]
        and dispatch.inputs[2] is None
        and dispatch.inputs[3] is None
        and rows is not None
        and rows == up.inputs[0]
        and row_idx is not None
        and row_idx == combine.inputs[1]
        and counts is not None
        and counts == up.inputs[3]
    )


def match_gating(gating, dispatch, combine) -> bool:
    """MoeGatingTopKSoftmax giving the dispatch its experts and the combine its scales (no
    ``finished`` input)."""
    probs, ids = gating.outputs[:2]
    return (
        gating.op.name == GATING
        and gating.inputs[1] is None
        and ids is not None
        and ids == dispatch.inputs[1]
        and probs is not None
        and probs == combine.inputs[5]
    )


def fuse_chains(steps: list) -> list:
    """``steps`` with each run of node steps that :func:`match` (five, else four) as one
    ExpertChainStep."""
    fused: list = []
    index = 0
    while index < len(steps):
        for size in (6, 5, 4):
            window = steps[index : index + size]
            if len(window) == size and match(window):
                fused.append(ExpertChainStep(window))
                index += size
                break
        else:
            fused.append(steps[index])
            index += 1
    return fused
