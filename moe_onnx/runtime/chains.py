"""Adjacent cann.moe nodes run as one step where a kernel computes them together.

One chain so far: the experts and the combine of an MoE layer, four nodes in a row::

    GroupedMatmul(rows, w_gate_up, -, counts) -> gate_up     (group_type 0, transpose_weight 1)
    SwiGlu(gate_up) -> act                                    (dim -1)
    GroupedMatmul(act, w_down, -, counts) -> down            (the same attributes, the same counts)
    MoeFinalizeRoutingV2(down, row_idx, -, -, -, scales) -> y (drop_pad_mode 0 or 2)

At decode :func:`moe_onnx.custom_ops.expert_chain.experts_and_combine` computes them in one
compiled call with the four ops' bits. The step keeps the four node steps: the first call at
each input signature runs them (inference and every static check, as always), and so does any
call the chain kernel declines (larger groups, values an op refuses: its error names its node).
Every named output of the four nodes is produced either way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..custom_ops import expert_chain
from ..custom_ops.opdef import max_bytes

#: the ops of the chain, in order
EXPERT_CHAIN = ("GroupedMatmul", "SwiGlu", "GroupedMatmul", "MoeFinalizeRoutingV2")


class ExpertChainStep:
    """Four adjacent node steps (``EXPERT_CHAIN``, their data flow checked by :func:`match`)."""

    def __init__(self, steps: list):
        self.steps = steps
        up, _, down, combine = (step.node for step in steps)
        self.cumulative = up.attrs.get("group_list_type", 0) == 0
        self.drop_pad_mode = combine.attrs.get("drop_pad_mode", 0)
        # the values read from outside the chain, in experts_and_combine's order
        self.external = [up.inputs[0], up.inputs[1], down.inputs[1], up.inputs[3], combine.inputs[1], combine.inputs[5]]
        self.produced = [up.outputs[0], steps[1].node.outputs[0], down.outputs[0], combine.outputs[0]]
        self._checked: dict[tuple, int] = {}  # input signature -> bytes of the four outputs

    @property
    def inputs(self) -> list[str | None]:
        return [name for step in self.steps for name in step.inputs]

    def run(self, values: dict[str, np.ndarray], context: dict[str, Any], run_options) -> None:
        arrays = [values[name] for name in self.external]
        key = tuple((a.dtype, a.shape) for a in arrays)
        nbytes = self._checked.get(key)
        if nbytes is not None and nbytes <= max_bytes():
            rows, w_gate_up, w_down, counts, row_idx, scales = arrays
            results = expert_chain.experts_and_combine(
                rows, w_gate_up, w_down, counts, self.cumulative, row_idx, scales, self.drop_pad_mode
            )
            if results is not None:
                for name, value in zip(self.produced, results):
                    values[name] = value
                return
        for step in self.steps:
            step.run(values, context, run_options)
        if len(self._checked) < 16:
            self._checked[key] = sum(values[name].nbytes for name in self.produced)


def match(steps: list) -> bool:
    """Whether four node steps are the chain: the ops and attributes above, each node reading
    the one before, both products grouped by the same counts, no bias, every output named."""
    if len(steps) != 4 or any(getattr(step, "node", None) is None for step in steps):
        return False
    nodes = [step.node for step in steps]
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
    inputs = combine.inputs + [None] * 7
    if combine.attrs.get("drop_pad_mode", 0) not in (0, 2) or any(inputs[i] is not None for i in (2, 3, 4, 6)):
        return False
    flows = (
        glu.inputs[0] == up.outputs[0],
        down.inputs[0] == glu.outputs[0],
        down.inputs[3] == up.inputs[3],
        inputs[0] == down.outputs[0],
        inputs[1] is not None and inputs[5] is not None,
    )
    named = all(node.outputs[0] for node in nodes)
    return all(flows) and named


def fuse_chains(steps: list) -> list:
    """``steps`` with each run of four node steps that :func:`match` as one ExpertChainStep."""
    fused: list = []
    index = 0
    while index < len(steps):
        window = steps[index : index + 4]
        if match(window):
            fused.append(ExpertChainStep(window))
            index += 4
        else:
            fused.append(steps[index])
            index += 1
    return fused
