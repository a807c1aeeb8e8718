"""Graph passes (on onnx-ir) that rewrite exported MoE graphs to use ``cann.moe`` ops.

``insert_rerouting`` finds each AllToAll whose received rows are regrouped by local expert
and replaces that chunk sort by one MoeReRoutingV2 node (and its restore by a Gather). The
recognised patterns are documented in :mod:`converters.chunk_sort`.

``lower`` gives every ``cann.moe`` op but the collectives a body in standard ONNX ops
(model-local functions, or inlined): see :mod:`converters.lower` and ``docs/lowering.md``.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

from .chunk_sort import RULES, GatherIndex, ReshapeTranspose, SplitConcat
from .graph_utils import DEFAULT_ALL_TO_ALL
from .lower import LowerToStandard, lower
from .reroute import AmbiguousMatch, ConversionReport, InsertRerouting


def insert_rerouting(model: ir.Model | onnx.ModelProto, all_to_all_ops=DEFAULT_ALL_TO_ALL):
    """Rewrite post-AlltoAll chunk sorts to MoeReRoutingV2.

    Args:
        model: an ``onnx_ir.Model`` (changed in place) or an ``onnx.ModelProto`` (left as
            it is: a new proto is returned).
        all_to_all_ops: (domain, op_type) pairs that count as AllToAll, besides any op whose
            type reads "alltoall".
    Returns:
        ``(model, report)``: the converted model (same kind as given) and a
        :class:`ConversionReport`. Raises :class:`AmbiguousMatch` and changes nothing if a
        candidate cannot be rewritten safely.
    """
    as_proto = isinstance(model, onnx.ModelProto)
    ir_model = ir.serde.deserialize_model(model) if as_proto else model
    rewrite = InsertRerouting(all_to_all_ops)
    rewrite(ir_model)
    if as_proto:
        return (ir.serde.serialize_model(ir_model) if rewrite.report.changed else model), rewrite.report
    return ir_model, rewrite.report


__all__ = [
    "AmbiguousMatch",
    "ConversionReport",
    "GatherIndex",
    "InsertRerouting",
    "LowerToStandard",
    "RULES",
    "ReshapeTranspose",
    "SplitConcat",
    "insert_rerouting",
    "lower",
]
