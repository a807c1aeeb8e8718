"""Graph passes (on onnx-ir) that rewrite exported MoE graphs to use ``cann.moe`` ops.

``insert_rerouting`` finds each AllToAll whose received rows are regrouped by local expert
and replaces that chunk sort by one MoeReRoutingV2 node (and its restore by a Gather). The
recognised chunk sorts (``reroute.RULES``), each beside its replacement and its restore:

* ``split_concat`` (:class:`SplitConcat`): ``Split(rows, sizes)`` + ``Concat`` expert-major;
  restore ``Split`` + ``Concat`` rank-major with sizes ``counts.T``; counts computed (probed);
* ``gather_index`` (:class:`GatherIndex`): ``Gather(rows, index(counts))``; restore
  ``ScatterND(zeros, index[:, None], y)``; counts computed (probed);
* ``drop_pad`` (:class:`ReshapeTranspose`): ``Reshape [N, L, C, H]`` + ``Transpose(1, 0, ...)``
  (+ back to rows); restore the transpose back (+ rows); counts ``full([N, L], C)``;
* ``gshard`` (:class:`ExpertSlices`): ``Reshape [N, L, C, M]`` + Split / Slice / Gather on axis 1;
  restore ``Concat(axis=1)`` of the experts' outputs; counts ``full([N, L], C)``.

Shared types (``ChunkSort``, ``Restore``, ``Counts``) are in :mod:`.sorts`; the dropless rules
in :mod:`.dropless`, the capacity rules in :mod:`.capacity`.

``lower`` gives every ``cann.moe`` op but the collectives a body in standard ONNX ops
(model-local functions, or inlined): see :mod:`converters.lower` and ``docs/lowering.md``.
"""

from __future__ import annotations

if __name__ != "moe_onnx.converters":  # the repository root on sys.path would load a second copy
    raise ImportError(f"import this package as 'moe_onnx.converters' (pip install -e .), not as {__name__!r}")

import onnx
import onnx_ir as ir

from .capacity import ExpertSlices, ReshapeTranspose
from .dropless import GatherIndex, SplitConcat
from .errors import AmbiguousMatch, BatchSpecificGraph, ConversionError
from .graph_utils import DEFAULT_ALL_TO_ALL
from .lower import LowerToStandard, lower
from .report import AllToAllReport, ConversionReport
from .reroute import RULES, InsertRerouting


def insert_rerouting(model: ir.Model | onnx.ModelProto, all_to_all_ops=DEFAULT_ALL_TO_ALL, strict: bool = False):
    """Rewrite post-AlltoAll chunk sorts to MoeReRoutingV2.

    Args:
        model: an ``onnx_ir.Model`` (changed in place) or an ``onnx.ModelProto`` (left as
            it is: a new proto is returned when anything changed, the same one otherwise).
        all_to_all_ops: (domain, op_type) pairs that count as AllToAll, besides any op whose
            type reads "alltoall".
        strict: refuse (:class:`BatchSpecificGraph`) a graph whose split sizes after an
            all-to-all are constants traced from one batch, instead of reporting it.
    Returns:
        ``(model, report)``: the converted model (same kind as given) and a
        :class:`ConversionReport`. Raises :class:`ConversionError` (:class:`AmbiguousMatch`
        when a candidate matches in two ways) naming the nodes, and then the model given is
        exactly as it was.
    """
    as_proto = isinstance(model, onnx.ModelProto)
    ir_model = ir.serde.deserialize_model(model) if isinstance(model, onnx.ModelProto) else model
    rewrite = InsertRerouting(all_to_all_ops, strict=strict)
    rewrite(ir_model)
    if as_proto:
        return (ir.serde.serialize_model(ir_model) if rewrite.report.changed else model), rewrite.report
    return ir_model, rewrite.report


__all__ = [
    "AllToAllReport",
    "AmbiguousMatch",
    "BatchSpecificGraph",
    "ConversionError",
    "ConversionReport",
    "ExpertSlices",
    "GatherIndex",
    "InsertRerouting",
    "LowerToStandard",
    "RULES",
    "ReshapeTranspose",
    "SplitConcat",
    "insert_rerouting",
    "lower",
]
