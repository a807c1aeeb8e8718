"""Split execution: our nodes run in-process, the other nodes in onnxruntime.

onnxruntime-extensions copies every input of a Python op into a new array and every output
into onnxruntime's tensor (SPEC section 2): for a memory-bound op, two more passes over its
bytes than the op itself makes. Here the graph is cut at our nodes instead. Each run of
consecutive native nodes becomes one onnxruntime session over a sub-model (a *segment*);
each of our nodes is a direct call of its ``OpDef``; tensors cross by reference both ways
(``OrtValue.numpy()`` wraps onnxruntime's memory, ``ortvalue_from_numpy`` wraps numpy's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from ..custom_ops import DOMAIN, TensorInfo, buffers, dtypes
from ..custom_ops.model_types import value_types
from ..custom_ops.opdef import NodeSignatures
from ..custom_ops.tensor_info import UNKNOWN
from . import ort_session
from .chains import ExpertChainStep, fuse_chains
from .nodes import BoundNode, bind_node, ours, reject_subgraph_ops
from .ort_session import from_ort, to_ort, without_spinning
from .pyops import session_options


class KernelStep:
    """One of our nodes, called directly; its signature inferred once per input shape."""

    def __init__(self, node: BoundNode):
        self.node = node
        self.signatures = NodeSignatures(node.op, node.attrs, node.wanted, node.name)

    @property
    def inputs(self) -> list[str | None]:
        return self.node.inputs

    def run(self, values: dict[str, np.ndarray], context: dict[str, Any], run_options) -> None:
        node = self.node
        inputs = tuple(None if name is None else dtypes.native(values[name]) for name in node.inputs)
        results = node.op.run_inferred(self.signatures(inputs), inputs, context)
        for name, value in zip(node.outputs, results):
            if name:
                assert value is not None  # inference refuses a named output the op would not produce
                values[name] = value


@dataclass
class SegmentStep:
    """A run of native nodes, executed by one onnxruntime session."""

    session: ort.InferenceSession
    inputs: list[str]
    outputs: list[str]

    def run(self, values: dict[str, np.ndarray], context: dict[str, Any], run_options) -> None:
        feeds = {name: to_ort(values[name]) for name in self.inputs}
        results = self.session.run_with_ort_values(self.outputs, feeds, run_options)
        values.update(zip(self.outputs, map(from_ort, results)))


class SplitExecutor:
    """The steps of one model and what each value needs (the ``"split"`` executor).

    Args:
        model: the model as given (never modified); its ``cann.moe`` nodes must sit in the
            main graph, not in control-flow subgraphs.
        base_dir: where external initializers live (None: the model has none).
        sess_options, providers, kwargs: for every segment's onnxruntime session.
        context: the objects injected into kernels.
    """

    ort_session = None  # several onnxruntime sessions, none of them the whole graph

    def __init__(
        self, model: onnx.ModelProto, base_dir: str | None, sess_options, providers: list[str], context, **kwargs
    ):
        self.context = context
        self.providers = providers
        options = without_spinning(sess_options or ort.SessionOptions())
        if _foreign_domains(model.graph):  # perhaps onnxruntime-extensions' own ops: register them
            options = session_options(options)

        def make_session(sub_model: onnx.ModelProto) -> ort.InferenceSession:
            return ort_session.create(sub_model, base_dir, options, providers, **kwargs)

        graph = model.graph
        reject_subgraph_ops(graph)
        self.types = value_types(model)
        initializers = {init.name: init for init in graph.initializer}
        sparse = {init.values.name: init for init in graph.sparse_initializer}
        self.input_names = [vi.name for vi in graph.input]
        self.output_names = [vi.name for vi in graph.output]
        produced = {name for node in graph.node for name in node.output if name}
        orphans = [
            name
            for name in self.output_names
            if name not in produced and name not in initializers and name not in self.input_names
        ]
        if orphans:
            raise ValueError(f"graph output(s) {orphans} are neither inputs, initializers nor produced by a node")

        groups: list[list[tuple[int, onnx.NodeProto]]] = []  # (index in the graph, node)
        for index, node in enumerate(graph.node):
            if ours(node) or not groups or ours(groups[-1][-1][1]):
                groups.append([(index, node)])
            else:
                groups[-1].append((index, node))
        needed_later = [set(self.output_names)]  # needed_later[i]: names read from group i on
        for group in reversed(groups):
            needed_later.append(needed_later[-1] | set().union(*(_node_inputs(n) for _, n in group)))
        needed_later.reverse()

        self.steps: list[KernelStep | SegmentStep | ExpertChainStep] = []
        kernel_reads: set[str] = set()
        for position, group in enumerate(groups):
            if ours(group[0][1]):
                step = KernelStep(bind_node(group[0][1], group[0][0], self.types))
                kernel_reads.update(name for name in step.inputs if name)
            else:
                step = self._segment_step(
                    model, [n for _, n in group], needed_later[position + 1], initializers, sparse, make_session
                )
                if step is None:  # nothing it computes is read: onnxruntime would refuse it
                    continue
            self.steps.append(step)
        if kernel_reads & set(sparse):
            raise ValueError(
                f"sparse initializer(s) {sorted(kernel_reads & set(sparse))} feed a cann.moe node; store them dense"
            )
        # initializers read outside segments (by our nodes, as outputs, as input defaults)
        direct = (kernel_reads | set(self.output_names) | set(self.input_names)) & set(initializers)
        self.constants = {name: _load(initializers[name], base_dir) for name in sorted(direct)}
        self.steps = fuse_chains(self.steps)
        self.last_use = self._last_use()

    def _segment_step(self, model, nodes, needed_later, initializers, sparse, make_session):
        """The segment running ``nodes``, or None when nothing it computes is read later."""
        produced = [name for node in nodes for name in node.output if name]
        outputs = [name for name in produced if name in needed_later]
        if not outputs:
            return None
        read = set().union(*map(_node_inputs, nodes)) - set(produced)
        inputs = sorted(
            name for name in read if (name not in initializers and name not in sparse) or name in self.input_names
        )
        inside = read - set(inputs)
        sub = helper.make_graph(
            nodes,
            f"{model.graph.name}_segment",
            [self._value_info(name) for name in inputs],
            [self._value_info(name) for name in outputs],
            initializer=[initializers[name] for name in sorted(inside) if name in initializers],
            sparse_initializer=[sparse[name] for name in sorted(inside) if name in sparse],
        )
        sub_model = helper.make_model(
            sub,
            opset_imports=[o for o in model.opset_import if o.domain != DOMAIN],
            ir_version=model.ir_version,
            functions=model.functions,
        )
        return SegmentStep(make_session(sub_model), inputs, outputs)

    def _value_info(self, name: str) -> onnx.ValueInfoProto:
        """Type and rank of a value crossing a cut; its dims stay free (the sizes are the
        running ones, which a traced annotation need not match)."""
        info = self.types.get(name, UNKNOWN)
        if info.dtype is None:
            raise ValueError(
                f"cannot tell the element type of '{name}', which crosses between "
                "onnxruntime and a cann.moe node (only tensors of known numeric type "
                "can); give it a type in the graph, or use executor='pyop'"
            )
        return TensorInfo(info.dtype, None if info.shape is None else (None,) * len(info.shape)).value_info(name)

    def _last_use(self) -> dict[str, int]:
        """Index of the last step reading each value (graph outputs: never dropped)."""
        last = {}
        for index, step in enumerate(self.steps):
            for name in step.inputs:
                if name:
                    last[name] = index
        for name in self.output_names:
            last[name] = len(self.steps)
        return last

    def get_providers(self) -> list[str]:
        return list(self.providers)

    def run(self, output_names: list[str], feeds: dict[str, np.ndarray], run_options=None) -> list[np.ndarray]:
        values: dict[str, np.ndarray] = {**self.constants, **feeds}
        with buffers.recycled_outputs():
            for index, step in enumerate(self.steps):
                step.run(values, self.context, run_options)
                for name in [n for n in step.inputs if n and self.last_use.get(n) == index]:
                    values.pop(name, None)  # free what no later step reads
        # an output over a constant's memory (returned, or passed through an Identity) is not
        # the caller's to change: give a copy
        outputs = [values[name] for name in output_names]
        constants = list(self.constants.values())
        return [o.copy() if any(np.may_share_memory(o, c) for c in constants) else o for o in outputs]


#: domains onnxruntime runs by itself (ours are cut out of the segments)
_ONNXRUNTIME_DOMAINS = {"", "ai.onnx", "ai.onnx.ml", "com.microsoft", "ai.onnx.preview.training"}


def _foreign_domains(graph: onnx.GraphProto) -> set[str]:
    """Domains of native nodes that onnxruntime does not know by itself. Only then does a
    segment need the extensions library, whose import also imports torch when it is installed
    (over a second) and switches child processes to the pure-Python protobuf."""
    found = set()
    for node in graph.node:
        if not ours(node) and node.domain not in _ONNXRUNTIME_DOMAINS:
            found.add(node.domain)
        for attr in node.attribute:  # control-flow bodies
            for body in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                found |= _foreign_domains(body)
    return found


def _node_inputs(node: onnx.NodeProto) -> set[str]:
    """The values a node reads, including those its subgraphs take from the outer scope."""
    names = {name for name in node.input if name}
    for attr in node.attribute:
        for graph in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
            defined = (
                {vi.name for vi in graph.input}
                | {init.name for init in graph.initializer}
                | {name for inner in graph.node for name in inner.output}
            )
            used = set().union(*map(_node_inputs, graph.node)) | {vi.name for vi in graph.output}
            names |= used - defined
    return names


def _load(tensor: onnx.TensorProto, base_dir: str | None) -> np.ndarray:
    """An initializer's value as numpy (bfloat16/float8 as ml_dtypes), external data read
    from ``base_dir``."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL and base_dir is None:
        raise ValueError(f"initializer '{tensor.name}' is external: give the model's path")
    return numpy_helper.to_array(tensor, base_dir or "")
