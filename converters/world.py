"""Evaluating one rank's graph on synthetic batches, without its peers: the mirror world.

A rank's graph cannot run alone: its collectives need the other ranks. The converter evaluates
it in the **mirror world**, where every rank holds the same batch as this one (a valid input of
the N-rank model, and the one a single graph can stand for): ``AllGather(x)`` gives N copies of
``x``; ``AllToAll(data, send_counts)`` on rank ``r`` receives, from every rank, the rows this
rank sends to rank ``r`` (``send_counts[r]`` rows, N times; ``com.microsoft::AllToAll``: the
r-th of N equal parts, N times). The rank index ``r`` is not written in a graph: callers try
the candidates (:meth:`World.received` for each r). Other ``cann.moe`` ops run their own
kernels (``OpDef.__call__``) with a :class:`MirrorCommunicator`; standard ops run in
``onnx.reference``. Only the part of the graph the asked values are computed from is
evaluated, and only if it reads at most :data:`MAX_WEIGHT_BYTES` of initializers.

Synthetic batches (:meth:`World.batches`): every graph input filled at its declared dims, a
symbolic dim given :data:`BASE_DIM` (and, when some input has one, twice and half that:
larger and smaller token counts), floats normal(0, 1) (seeded), integers 0 or 1; plus a
*skewed* batch, every token nearly the same row (the largest expert counts a batch can have).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir

from moe_onnx.custom_ops import ALL_OPS, MoeOpError

#: the initializers an evaluation may read (a router's weights, not a whole model's)
MAX_WEIGHT_BYTES = 256 << 20
#: the nodes an evaluation may run
MAX_NODES = 5000
#: what a symbolic input dim is set to in the synthetic batches (and 2x, 1/2 of it)
BASE_DIM = 16
#: the elements of one synthetic batch (all inputs)
MAX_BATCH_ELEMENTS = 1 << 24


class WorldUnavailable(Exception):
    """The graph cannot be evaluated here (an op with no kernel, too many weights...)."""


class WorldFailure(Exception):
    """The graph itself failed on a synthetic batch; ``node`` names where."""

    def __init__(self, node: str, message: str):
        super().__init__(f"{node}: {message}")
        self.node = node
        self.message = message


class MirrorCommunicator:
    """The kernels' communicator in a world of ``size`` ranks that all hold this rank's batch."""

    def __init__(self, rank: int, size: int):
        self.rank = rank
        self.size = size

    def allgather(self, value: object, label: str) -> list:
        return [value] * self.size

    def alltoallv(self, send: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray) -> np.ndarray:
        start = int(send_counts[: self.rank].sum())
        block = send[start : start + int(send_counts[self.rank])]  # what this rank sends to rank `rank`
        return np.concatenate([block] * self.size)


def mirror_received(data: np.ndarray, send_counts: np.ndarray | None, ranks: int, rank: int) -> np.ndarray:
    """What rank ``rank`` receives from an AllToAll in the mirror world (``send_counts`` None:
    equal parts, as ``com.microsoft::AllToAll``)."""
    if send_counts is None:
        part = len(data) // ranks
        return np.concatenate([data[rank * part : (rank + 1) * part]] * ranks)
    counts = np.asarray(send_counts, np.int64).ravel()
    if len(counts) != ranks or counts.min(initial=0) < 0 or int(counts.sum()) != len(data):
        raise WorldFailure("AllToAll", f"send counts {counts.tolist()} do not split {len(data)} rows in {ranks}")
    start = int(counts[:rank].sum())
    return np.concatenate([data[start : start + int(counts[rank])]] * ranks)


@dataclass
class Batch:
    """One synthetic batch: the graph inputs it fills and how it was made."""

    name: str  # "random 1", "skewed", "long", ...
    feeds: dict[str, np.ndarray] = field(default_factory=dict)

    def describe(self) -> str:
        shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in self.feeds.items())
        return f"the {self.name} batch ({shapes})"


class World:
    """One rank's graph, evaluated on synthetic batches in the mirror world (of N ranks: each
    evaluation says N)."""

    def __init__(self, model: ir.Model):
        self.model = model
        self.graph = model.graph
        self._results: dict[tuple, dict[str, np.ndarray]] = {}  # (batch, N, rank) -> every value computed
        self._evaluators: dict[int, tuple] = {}
        self._position: dict[int, int] | None = None
        self._batches: list[Batch] | None = None

    # ------------------------------------------------------------------ batches
    def symbolic(self) -> list[str]:
        """Graph inputs with a dim that is not a number (their names)."""
        return [
            v.name or ""
            for v in self.graph.inputs
            if not v.is_initializer() and (v.shape is None or any(not isinstance(d, int) for d in v.shape.dims))
        ]

    def batches(self) -> list[Batch]:
        if self._batches is not None:
            return self._batches
        sizes = [("random 1", BASE_DIM, False, 1), ("random 2", BASE_DIM, False, 2), ("skewed", BASE_DIM, True, 3)]
        if self.symbolic():
            sizes += [("long", 2 * BASE_DIM, False, 4), ("short", BASE_DIM // 2, False, 5)]
        self._batches = [self._batch(name, dim, skew, seed) for name, dim, skew, seed in sizes]
        return self._batches

    def _batch(self, name: str, dim: int, skew: bool, seed: int) -> Batch:
        rng = np.random.default_rng(seed)
        batch = Batch(name)
        total = 0
        for value in self.graph.inputs:
            if value.is_initializer():
                continue
            dims = [] if value.shape is None else [d if isinstance(d, int) else dim for d in value.shape.dims]
            total += math.prod(dims)
            if total > MAX_BATCH_ELEMENTS:
                raise WorldUnavailable(
                    f"a synthetic batch of the graph's inputs would take more than {MAX_BATCH_ELEMENTS} elements"
                )
            dtype = value.dtype.numpy() if value.dtype is not None else np.dtype(np.float32)
            array: np.ndarray
            if np.issubdtype(dtype, np.floating):
                if skew and dims:  # one token and small noise: all tokens route alike, without ties
                    one = rng.standard_normal([1] * (len(dims) - 1) + dims[-1:])
                    array = one + 0.05 * rng.standard_normal(dims)
                else:
                    array = rng.standard_normal(dims)
            elif dtype == np.bool_:
                array = rng.integers(0, 2, dims).astype(bool)
            else:
                array = rng.integers(0, 2, dims)
            batch.feeds[value.name or ""] = np.asarray(array).astype(dtype)
        return batch

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, batch: Batch, values: list[ir.Value], ranks: int, rank: int = 0) -> dict[str, np.ndarray]:
        """``{name: array}`` of ``values`` as the graph computes them on ``batch`` (mirror world
        of ``ranks`` ranks, this one ``rank`` for the collectives on the way). Raises
        :class:`WorldFailure` (the graph failed) or :class:`WorldUnavailable` (cannot be
        evaluated here). Every value computed is kept for the next call on the same batch."""
        nodes, initializers, inputs = self._cone(values)
        results = self._results.setdefault((batch.name, ranks, rank), {})
        missing = [name for name in inputs if name not in batch.feeds]
        if missing:
            raise WorldUnavailable(f"the values to check are computed from {missing}, which no batch fills")
        for name in inputs:
            results.setdefault(name, batch.feeds[name])
        for name, value in initializers.items():
            if name not in results:
                try:
                    results[name] = value.const_value.numpy()  # type: ignore[union-attr]
                except Exception as error:  # external data that is not there
                    raise WorldUnavailable(f"initializer '{name}' cannot be read: {error}") from None
        evaluator, communicator = self._evaluator(ranks)
        communicator.rank = rank
        for index in nodes:
            node = evaluator.rt_nodes_[index]
            proto = node.onnx_node
            if all(name in results for name in proto.output if name):
                continue
            inputs_ = [results.get(name) if name else None for name in proto.input]
            try:
                outputs = node.run(*inputs_, context=results) if node.need_context() else node.run(*inputs_)
            except WorldUnavailable:
                raise
            except Exception as error:
                message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                raise WorldFailure(f"{proto.op_type} '{proto.name}'", message[:300]) from None
            results.update(zip(proto.output, outputs))
        return {v.name or "": np.asarray(results[v.name or ""]) for v in values}

    def _evaluator(self, ranks: int):
        """One onnx.reference evaluator of the whole graph per N (its nodes are run one by one)."""
        if ranks not in self._evaluators:
            from onnx import helper
            from onnx.reference import ReferenceEvaluator

            graph = helper.make_graph(
                [ir.serde.serialize_node(n) for n in self.graph],
                "world",
                [
                    helper.make_tensor_value_info(v.name or "", onnx.TensorProto.UNDEFINED, None)
                    for v in self.graph.inputs
                ]
                + [
                    helper.make_tensor_value_info(k, onnx.TensorProto.UNDEFINED, None)
                    for k in self.graph.initializers
                    if k not in {v.name for v in self.graph.inputs}
                ],
                [
                    helper.make_tensor_value_info(v.name or "", onnx.TensorProto.UNDEFINED, None)
                    for v in self.graph.outputs
                ],
            )
            opsets = [helper.make_opsetid(d, v) for d, v in self.graph.opset_imports.items()]
            model = helper.make_model(graph, opset_imports=opsets)
            model.functions.extend(ir.serde.serialize_function(f) for f in self.model.functions.values())
            communicator = MirrorCommunicator(0, ranks)
            try:
                evaluator = ReferenceEvaluator(model, new_ops=_kernel_ops(model, communicator, ranks))
            except Exception as error:
                raise WorldUnavailable(
                    f"onnx.reference cannot load the graph: {type(error).__name__}: {error}"
                ) from None
            self._evaluators[ranks] = (evaluator, communicator)
        return self._evaluators[ranks]

    def _cone(self, values: list[ir.Value]) -> tuple[list[int], dict[str, ir.Value], list[str]]:
        """The nodes ``values`` are computed by (their indices in graph order), the initializers
        and the graph inputs they read; at most MAX_NODES nodes and MAX_WEIGHT_BYTES of weights."""
        position = self._positions()
        nodes: set[int] = set()
        inputs: dict[str, ir.Value] = {}
        initializers: dict[str, ir.Value] = {}
        pending: list[ir.Value | None] = list(values)
        seen: set[int] = set()
        while pending:
            value = pending.pop()
            if value is None or id(value) in seen:
                continue
            seen.add(id(value))
            if value.is_initializer() or (value.producer() is None and value.const_value is not None):
                initializers[value.name or ""] = value
                continue
            node = value.producer()
            if node is None:
                inputs[value.name or ""] = value
                continue
            if position[id(node)] not in nodes:
                nodes.add(position[id(node)])
                if len(nodes) > MAX_NODES:
                    raise WorldUnavailable(f"more than {MAX_NODES} nodes compute the values to check")
                pending.extend(node.inputs)
                for attr in node.attributes.values():  # outer-scope reads of subgraphs
                    if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
                        graphs = attr.value if isinstance(attr.value, list) else [attr.value]
                        for sub in graphs:
                            pending.extend(v for n in sub for v in n.inputs if v is not None and v.graph is not sub)
        size = sum(int(v.const_value.nbytes) for v in initializers.values() if v.const_value is not None)
        if size > MAX_WEIGHT_BYTES:
            raise WorldUnavailable(f"the values to check are computed from {size >> 20} MiB of weights")
        for name, value in initializers.items():
            if value.const_value is None:
                raise WorldUnavailable(f"initializer '{name}' has no value")
        return sorted(nodes), initializers, list(inputs)

    def _positions(self) -> dict[int, int]:
        if self._position is None:
            self._position = {id(n): i for i, n in enumerate(self.graph)}
        return self._position


def gather_elements(data: np.ndarray, indices: np.ndarray, axis: int = 0) -> np.ndarray:
    """ONNX GatherElements: ``out[i][j] = data[indices[i][j]][j]`` (axis 0; likewise on any
    axis), ``out`` shaped as ``indices``, whose other dims may be shorter than ``data``'s.

    Replaces onnx.reference's, which picks with ``np.choose``: numpy takes at most 64 choices,
    and its fallback for more keeps one index per row (a router's top-8 of 256 experts failed).
    """
    axis = axis % data.ndim
    index = np.where(indices < 0, indices + data.shape[axis], indices)
    window = tuple(slice(None) if d == axis else slice(0, n) for d, n in enumerate(index.shape))
    return np.take_along_axis(data[window], index, axis)


def _standard_ops() -> list[type]:
    """onnx.reference ops replaced by ours (see each function)."""
    from onnx.reference.op_run import OpRun

    def run(self, data, indices, axis=0):
        return (gather_elements(data, indices, axis),)

    return [type("GatherElements", (OpRun,), {"op_domain": "", "_run": run})]


def _kernel_ops(model: onnx.ModelProto, communicator: MirrorCommunicator, ranks: int) -> list[type]:
    """onnx.reference ops for every non-standard node: our kernels (with the mirror communicator);
    any other all-to-all by the mirror rule; anything else cannot be evaluated (raises when run);
    and the standard ops :func:`_standard_ops` replaces."""
    from onnx.reference.op_run import OpRun

    classes: dict[tuple[str, str], type] = {("", c.__name__): c for c in _standard_ops()}
    for node in model.graph.node:
        domain = node.domain or ""
        if domain in ("", "ai.onnx") or (domain, node.op_type) in classes:
            continue
        op = ALL_OPS.get((domain, node.op_type))
        run: Callable[..., tuple]
        if op is not None:

            def run_kernel(self, *inputs, _op=op, **attrs):
                try:
                    outputs = _op(
                        *inputs, node_name=self.onnx_node.name, context={"communicator": communicator}, **attrs
                    )
                    return tuple(outputs)[: len(self.onnx_node.output)]  # absent trailing optional outputs: None
                except MoeOpError as error:
                    raise RuntimeError(str(error)) from None

            run = run_kernel
        elif node.op_type.lower().replace("_", "") == "alltoall":  # graph_utils.is_all_to_all, by name

            def run_mirror(self, data, send_counts=None, **attrs):
                received = mirror_received(data, send_counts, ranks, communicator.rank)
                counts = (
                    None if send_counts is None else np.full(ranks, np.asarray(send_counts).ravel()[communicator.rank])
                )
                return (received,) if counts is None else (received, counts)

            run = run_mirror
        else:

            def run_unknown(self, *inputs, _what=f"{domain}::{node.op_type}", **attrs):
                raise WorldUnavailable(f"no kernel for {_what} (node '{self.onnx_node.name}')")

            run = run_unknown

        classes[(domain, node.op_type)] = type(node.op_type, (OpRun,), {"op_domain": domain, "_run": run})
    return list(classes.values())


__all__ = [
    "BASE_DIM",
    "Batch",
    "MirrorCommunicator",
    "World",
    "WorldFailure",
    "WorldUnavailable",
    "mirror_received",
]
