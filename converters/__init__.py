"""Graph passes (on onnx-ir) that rewrite exported MoE graphs to use ``cann.moe`` ops.

``insert_rerouting`` finds each AllToAll whose received rows are regrouped by local expert
and replaces that chunk sort by one MoeReRoutingV2 node (and its restore by a Gather). There is
one rule, :class:`MovementMap` (:mod:`.movement_map`): the chunk sort is recognised by where its
rows go, not by how it is spelled: the movement ops between the all-to-all and the experts are
cut out of the graph and evaluated on probe rows (:mod:`.movement`), and accepted when every
expert input holds MoeReRoutingV2's expert-major rows; the same from the experts' outputs to the
return all-to-all for the restore. Counts are computed (probed), constants, or computed at run
time from the rows (capacity layouts of a symbolic C). Constant counts are checked against what
the graph computes on synthetic batches (:mod:`.batch_check`, :mod:`.world`): batch-specific
graphs are reported. docs/converters.md has the principle and its limits.

Shared types (``ChunkSort``, ``Piece``, ``Restore``, ``Counts``) are in :mod:`.sorts`.

``fuse_moe`` finds each MoE block of a transformers-5 export (``batched_mm`` or ``grouped_mm``) and
replaces it by the cann.moe chain, each block checked on synthetic batches first
(:mod:`.fuse_moe`, :mod:`.moe_blocks`, docs/transformers.md).

``lower`` gives every ``cann.moe`` op but the collectives a body in standard ONNX ops
(model-local functions, or inlined): see :mod:`converters.lower` and ``docs/lowering.md``.
"""

from __future__ import annotations

if __name__ != "moe_onnx.converters":  # the repository root on sys.path would load a second copy
    raise ImportError(f"import this package as 'moe_onnx.converters' (pip install -e .), not as {__name__!r}")

import os

import onnx
import onnx_ir as ir

from .errors import AmbiguousMatch, BatchSpecificGraph, ConversionError
from .fuse_moe import BlockReport, FuseMoe, FuseReport
from .graph_utils import DEFAULT_ALL_TO_ALL
from .lower import LowerToStandard, lower
from .model_input import as_ir
from .movement_map import MovementMap
from .report import AllToAllReport, ConversionReport
from .reroute import RULES, InsertRerouting
from .shard import NotShardable, ShardExperts, ShardReport


def insert_rerouting(
    model: ir.Model | onnx.ModelProto | str | os.PathLike, all_to_all_ops=DEFAULT_ALL_TO_ALL, strict: bool = False
):
    """Rewrite post-AlltoAll chunk sorts to MoeReRoutingV2.

    Args:
        model: an ``onnx_ir.Model`` (changed in place), an ``onnx.ModelProto`` (left as
            it is: a new proto is returned when anything changed, the same one otherwise),
            or a path to a model file (read with its external data referenced, not loaded;
            an ``onnx_ir.Model`` is returned: ``onnx_ir.save`` writes it).
        all_to_all_ops: (domain, op_type) pairs that count as AllToAll, besides any op whose
            type reads "alltoall".
        strict: refuse (:class:`BatchSpecificGraph`) a graph whose chunk sort relies on
            constants traced from one batch (the graph contradicts them), instead of reporting it.
    Returns:
        ``(model, report)``: the converted model (same kind as given) and a
        :class:`ConversionReport`. An all-to-all whose chunk sort is ambiguous or cannot be
        examined is skipped with the reason in its report entry. Raises
        :class:`ConversionError` (a failure while rewriting; :class:`BatchSpecificGraph` when
        ``strict``) naming the nodes, and then the model given is exactly as it was.
    """
    as_proto = isinstance(model, onnx.ModelProto)
    ir_model = as_ir(model)
    rewrite = InsertRerouting(all_to_all_ops, strict=strict)
    rewrite(ir_model)
    if as_proto:
        return (ir.serde.serialize_model(ir_model) if rewrite.report.changed else model), rewrite.report
    return ir_model, rewrite.report


def shard_experts(model: ir.Model | onnx.ModelProto, ranks: int):
    """Split a single-device model of ``cann.moe`` chain MoE layers over ``ranks`` expert-parallel
    ranks (:mod:`.shard`: rows to their experts' rank by AllToAll, MoeReRoutingV2 to expert order,
    each rank holding E / N experts' weights; everything else data parallel).

    Returns ``(models, report)``: rank r's model is ``models[r]`` (the kind given: ``onnx_ir.Model``
    or ``onnx.ModelProto``), and a :class:`ShardReport`. Raises :class:`NotShardable` naming the
    node and the rule (E % N != 0, drop/pad routing, a non row-wise op among the experts, ...);
    the model given is never changed.
    """
    as_proto = isinstance(model, onnx.ModelProto)
    ir_model = as_ir(model)
    shard = ShardExperts(ranks)
    shards = shard(ir_model)
    return ([ir.serde.serialize_model(m) for m in shards] if as_proto else shards), shard.report


def fuse_moe(model: ir.Model | onnx.ModelProto):
    """Replace each MoE block a transformers-5 export computes by the cann.moe chain.

    Args:
        model: an ``onnx_ir.Model`` (changed in place) or an ``onnx.ModelProto`` (left as it
            is: a new proto is returned when a block was fused, the same one otherwise).
    Returns:
        ``(model, report)``: the fused model (same kind as given) and a :class:`FuseReport`
        saying per block whether it was fused and, if not, why.
    """
    as_proto = isinstance(model, onnx.ModelProto)
    ir_model = as_ir(model)
    fuse = FuseMoe()
    fuse(ir_model)
    if as_proto:
        return (ir.serde.serialize_model(ir_model) if fuse.report.changed else model), fuse.report
    return ir_model, fuse.report


__all__ = [
    "AllToAllReport",
    "AmbiguousMatch",
    "BatchSpecificGraph",
    "BlockReport",
    "ConversionError",
    "ConversionReport",
    "FuseMoe",
    "FuseReport",
    "InsertRerouting",
    "LowerToStandard",
    "MovementMap",
    "NotShardable",
    "RULES",
    "ShardExperts",
    "ShardReport",
    "fuse_moe",
    "insert_rerouting",
    "lower",
    "shard_experts",
]
