"""What the rules may ask of a graph beyond its nodes: shapes, static values, probe evaluations.

Exporters spell the same quantity many ways (a constant; ``Concat`` of scalar chains; a shape
computed from ``Shape()``...). The rules do not read spellings: they ask

* :meth:`GraphFacts.shape` — a value's dims, from its own annotation or from ONNX shape
  inference run once on a copy of the graph (the model is never touched);
* :meth:`GraphFacts.static` — a value that is the same whatever the unknown dims are: the
  expression is evaluated (``onnx.reference``) on a few probe shapes, and kept only if every
  probe gives the same result;
* :class:`Expression` — a value as a function of other values (standard ops and constants
  only), to evaluate on probe counts: the split sizes are what they compute, not how.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from .evaluators import reference_evaluator
from .graph_utils import constant, is_standard

Dims = tuple[int | None, ...]

#: an expression slice this large is not a size or index computation
_MAX_SLICE_NODES = 400
#: constants read into a probe model at most this large (a probe never reads the weights)
_MAX_CONSTANT_ELEMENTS = 1 << 16
#: values given to unknown dims when probing whether a shape expression is static
_PROBE_DIMS = ((6, 10, 14, 22), (9, 15, 21, 33), (4, 12, 20, 28), (97, 61, 43, 29))


def _small_array(value: ir.Value) -> np.ndarray | None:
    """The constant's content if it is small (a size or index, not a weight) and readable.

    A small tensor in external data is read (its file must be there); a large one never is."""
    tensor = value.const_value
    if tensor is None or tensor.size > _MAX_CONSTANT_ELEMENTS:
        return None
    try:
        return tensor.numpy()
    except Exception:  # an external file that is not there: the value is unknown
        return None


class Expression:
    """``target`` computed from ``sources`` by standard ONNX ops and constants only.

    Built by :meth:`between`; calling it with one array per source evaluates the slice with
    ``onnx.reference`` (used on small probe inputs only).
    """

    def __init__(self, model: onnx.ModelProto, sources: list[ir.Value]):
        self.sources = sources
        self._evaluator = reference_evaluator(model)
        self._names = [s.name or "" for s in sources]

    @classmethod
    def between(
        cls, target: ir.Value, stop: Sequence[ir.Value] | Callable[[ir.Value], bool], dtypes: GraphFacts | None = None
    ) -> Expression | None:
        """The slice from ``stop`` (values, or a predicate marking them) to ``target``; None if
        anything else feeds it (a graph input, a custom op, a subgraph, a large constant)."""
        if callable(stop):
            is_source = stop
        else:
            ids = {id(v) for v in stop}

            def is_source(v: ir.Value) -> bool:
                return id(v) in ids

        nodes: dict[int, ir.Node] = {}
        constants: dict[int, ir.Value] = {}
        sources: dict[int, ir.Value] = {}
        pending: list[ir.Value | None] = [target]
        while pending:
            value = pending.pop()
            if value is None or id(value) in sources or id(value) in constants:
                continue
            if is_source(value):
                sources[id(value)] = value
                continue
            if value.is_initializer() or value.const_value is not None:
                if _small_array(value) is None:
                    return None
                constants[id(value)] = value
                continue
            node = value.producer()
            if (
                node is None
                or not is_standard(node)
                or any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values())
            ):
                return None
            if id(node) in nodes:
                continue
            nodes[id(node)] = node
            if len(nodes) > _MAX_SLICE_NODES:
                return None
            pending.extend(node.inputs)
        graph = target.graph
        ordered = [n for n in graph if id(n) in nodes] if graph is not None else list(nodes.values())
        opset = graph.opset_imports.get("", 21) if graph is not None else 21
        source_list = list(sources.values())
        model = _slice_model(ordered, list(constants.values()), source_list, target, opset, dtypes)
        try:
            return cls(model, source_list)
        except Exception:  # onnx.reference could not load the slice (an op it lacks)
            return None

    def __call__(self, *arrays: np.ndarray) -> np.ndarray:
        results = self._evaluator.run(None, dict(zip(self._names, arrays)))
        assert isinstance(results, list)  # a dict only with intermediate=True
        return np.asarray(results[0])


def _slice_model(
    nodes: list[ir.Node],
    constants: list[ir.Value],
    sources: list[ir.Value],
    target: ir.Value,
    opset: int,
    facts: GraphFacts | None,
) -> onnx.ModelProto:
    from onnx import helper, numpy_helper

    def elem_type(value: ir.Value) -> int:
        dtype = value.dtype if value.dtype is not None else (facts.dtype(value) if facts is not None else None)
        return int(dtype) if dtype is not None else onnx.TensorProto.INT64

    initializers = []
    for value in constants:
        array = _small_array(value)
        assert array is not None and value.name is not None  # Expression.between checked both
        initializers.append(numpy_helper.from_array(array, value.name))
    assert target.name is not None  # onnx-ir names every node output of a graph
    graph = helper.make_graph(
        [ir.serde.serialize_node(n) for n in nodes],
        "probe",
        [helper.make_tensor_value_info(s.name or "", elem_type(s), None) for s in sources],
        [helper.make_tensor_value_info(target.name, onnx.TensorProto.UNDEFINED, None)],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


class GraphFacts:
    """Shapes and static values of one graph, computed once (read-only: the graph is not changed).

    ``shape(v)`` merges the value's own annotation with ONNX shape inference (with data
    propagation) run on a skeleton copy: the nodes, small constants, and the large
    initializers as typed inputs, so no weight is copied or read.
    """

    def __init__(self, model: ir.Model):
        self._inferred: dict[str, tuple[int, Dims | None]] = {}
        self._static: dict[int, np.ndarray | None] = {}
        try:
            inferred = onnx.shape_inference.infer_shapes(
                _skeleton(model), check_type=False, strict_mode=False, data_prop=True
            )
        except Exception:  # shape inference is a help, not a requirement: the rules then see less
            return
        graph = inferred.graph
        for info in (*graph.value_info, *graph.output, *graph.input):
            tensor_type = info.type.tensor_type
            if not info.type.HasField("tensor_type"):
                continue
            dims = (
                tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim)
                if tensor_type.HasField("shape")
                else None
            )
            self._inferred[info.name] = (tensor_type.elem_type, dims)

    def shape(self, value: ir.Value | None) -> Dims | None:
        """Dims of ``value`` (None for an unknown dim), or None if its rank is unknown."""
        if value is None:
            return None
        if value.const_value is not None:
            return tuple(d if isinstance(d, int) else None for d in value.const_value.shape)
        own = None if value.shape is None else tuple(d if isinstance(d, int) else None for d in value.shape.dims)
        inferred = self._inferred.get(value.name or "", (0, None))[1]
        if own is None:
            return inferred
        if inferred is not None and len(inferred) == len(own):
            return tuple(o if o is not None else i for o, i in zip(own, inferred))
        return own

    def dtype(self, value: ir.Value) -> ir.DataType | None:
        if value.dtype is not None:
            return value.dtype
        elem_type = self._inferred.get(value.name or "", (0, None))[0]
        return ir.DataType(elem_type) if elem_type else None

    def static(self, value: ir.Value | None) -> np.ndarray | None:
        """The value if it is constant, or computed from constants and known dims only.

        Shapes computed from ``Shape(x)`` count as static when every probe of ``x``'s unknown
        dims gives the same result (e.g. ``Concat([2], [2], [6], Gather(Shape(y), 1))`` with
        ``y [?, 16]``).
        """
        if value is None:
            return None
        if id(value) in self._static:
            return self._static[id(value)]
        found = constant(value)
        if found is None:
            found = self._probe_static(value)
        self._static[id(value)] = found
        return found

    def _probe_static(self, value: ir.Value) -> np.ndarray | None:
        def is_shape(v: ir.Value) -> bool:
            node = v.producer()
            return node is not None and node.op_type == "Shape" and is_standard(node)

        expression = Expression.between(value, is_shape, self)
        if expression is None:
            return None
        shapes = []
        for source in expression.sources:
            node = source.producer()
            assert node is not None  # a Shape node, by is_shape
            dims = self.shape(node.inputs[0])
            if dims is None:
                return None
            shapes.append((dims, node))
        results = []
        for probe in _PROBE_DIMS:
            feeds = []
            for dims, node in shapes:
                filled = [d if d is not None else probe[i % len(probe)] for i, d in enumerate(dims)]
                start = node.attributes.get_int("start", 0)
                end = node.attributes.get_int("end", len(filled))
                feeds.append(np.array(filled, np.int64)[slice(start, end)])
            try:
                results.append(expression(*feeds))
            except Exception:  # the probe shape made the expression fail: not provably static
                return None
        first = results[0]
        return first if all(r.shape == first.shape and np.array_equal(r, first) for r in results[1:]) else None


def _skeleton(model: ir.Model) -> onnx.ModelProto:
    """The model's graph for shape inference: large or external initializers become typed inputs."""
    from onnx import helper, numpy_helper

    graph = model.graph
    initializers, inputs = [], []
    for name, value in graph.initializers.items():
        array = _small_array(value)
        try:
            if array is None:
                raise ValueError("large or unreadable")
            initializers.append(numpy_helper.from_array(array, name))
        except Exception:  # large, unreadable, or of a type numpy_helper does not write: a typed input
            inputs.append(ir.serde.serialize_value(value))
    seen = {p.name for p in initializers} | {p.name for p in inputs}
    inputs += [ir.serde.serialize_value(v) for v in graph.inputs if v.name not in seen]
    proto_graph = helper.make_graph(
        [ir.serde.serialize_node(n) for n in graph],
        graph.name or "graph",
        inputs,
        [ir.serde.serialize_value(v) for v in graph.outputs],
        initializers,
    )
    opsets = [helper.make_opsetid(domain, version) for domain, version in graph.opset_imports.items()]
    proto = helper.make_model(proto_graph, opset_imports=opsets, ir_version=model.ir_version)
    proto.functions.extend(ir.serde.serialize_function(f) for f in model.functions.values())
    return proto
