"""The two ``cann.moe`` collectives as torch ops, exportable with both exporters (scratch).

NOTE: this is the only place the peers' layers are changed beyond their own code, and it is a
stand-in: the ``moe_onnx.torch`` frontend (branch torch-frontend) brings the official torch ops
and translations of ``cann.moe::AllToAll`` / ``AllGather`` (and of torch's functional
collectives and stable sort). Once it is merged, ``make_exports.py`` should use its
``translation_table()`` / ops instead of this module, and the corpus be regenerated.

Eager: ``torch.ops.peers.all_to_all(data, send_counts [N] int64) -> (recv, recv_counts)`` and
``torch.ops.peers.all_gather(x) -> [N, *x.shape]`` run ``torch.distributed`` on the default group
(gloo). Export: ``translation_table()`` (dynamo) and ``register_legacy_symbolics()`` (TorchScript)
both emit exactly

    cann.moe::AllToAll(data [S, ...], send_counts [N] int64) -> (recv_data, recv_counts [N] int64)
    cann.moe::AllGather(x) -> y [N, *x.shape]

``import moe_onnx`` must run before an export: onnxscript reads an op's output count from its
ONNX schema, which moe_onnx registers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import moe_onnx  # noqa: F401  (registers the cann.moe schemas, AllGather included)

DOMAIN = "cann.moe"


# ---------------------------------------------------------------- eager ops
@torch.library.custom_op("peers::all_to_all", mutates_args=())
def all_to_all(data: torch.Tensor, send_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged all-to-all on the default group: rows ``send_counts[r]`` go to rank r."""
    send_counts = send_counts.to(torch.int64).contiguous()
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    data = data.contiguous()
    recv = data.new_empty((int(recv_counts.sum()), *data.shape[1:]))
    dist.all_to_all_single(recv, data, recv_counts.tolist(), send_counts.tolist())
    return recv, recv_counts


@all_to_all.register_fake
def _(data, send_counts):
    rows = torch.library.get_ctx().new_dynamic_size()  # data-dependent: an unbacked symbol
    return data.new_empty((rows, *data.shape[1:])), send_counts.new_empty(send_counts.shape, dtype=torch.int64)


@torch.library.custom_op("peers::all_gather", mutates_args=())
def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x`` stacked along a new dim 0, in rank order."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.stack(parts)


@all_gather.register_fake
def _(x):
    return x.new_empty((dist.get_world_size(), *x.shape))


# ---------------------------------------------------------------- dynamo translations
def translation_table():
    """torch op -> onnxscript function, for ``torch.onnx.export(dynamo=True, custom_translation_table=...)``."""
    from onnxscript import ir
    from onnxscript import opset18 as op
    from onnxscript.values import Opset

    cann = Opset(DOMAIN, 1)

    def all_to_all_onnx(data, send_counts):
        recv, counts = cann.AllToAll(data, send_counts)
        return recv, counts

    def all_gather_onnx(x):
        return cann.AllGather(x)

    def aten_sort_stable(self, stable=None, dim=-1, descending=False):
        """torch's stable sort (ties keep index order), needed for Megatron's argsort of the routing
        map. Integer/bool keys: TopK on the unique int64 key x*M + i (ascending) / x*M + (M-1-i)
        (descending); float keys: TopK, whose ONNX spec breaks ties by lower index."""
        m = op.Gather(op.Shape(self), dim)  # scalar M
        m1 = op.Reshape(m, [1])
        largest = 1 if descending else 0
        integer = (ir.DataType.BOOL, ir.DataType.INT8, ir.DataType.UINT8, ir.DataType.INT16, ir.DataType.INT32)
        if self.dtype in (*integer, ir.DataType.INT64):
            iota = op.Range(op.Constant(value_int=0), m, op.Constant(value_int=1))
            rank = len(self.shape) if self.shape is not None else 1
            axis = dim % rank
            if axis != rank - 1:
                iota = op.Reshape(iota, [-1] + [1] * (rank - 1 - axis))
            tie = op.Sub(op.Sub(m, 1), iota) if descending else iota
            key = op.Add(op.Mul(op.Cast(self, to=ir.DataType.INT64), m), tie)
            _, idx = op.TopK(key, m1, axis=dim, largest=largest, sorted=1)
            values = op.GatherElements(self, idx, axis=dim)
        else:
            values, idx = op.TopK(self, m1, axis=dim, largest=largest, sorted=1)
        return values, idx

    return {
        torch.ops.aten.sort.stable: aten_sort_stable,
        torch.ops.peers.all_to_all.default: all_to_all_onnx,
        torch.ops.peers.all_gather.default: all_gather_onnx,
    }


# ---------------------------------------------------------------- legacy (TorchScript) symbolics
def register_legacy_symbolics(opset: int = 17) -> None:
    from torch.onnx import register_custom_op_symbolic
    from torch.onnx import symbolic_helper as sh

    def a2a_symbolic(g, data, send_counts):
        recv, counts = g.op(f"{DOMAIN}::AllToAll", data, send_counts, outputs=2)
        sizes = data.type().sizes()
        if sizes is not None:
            recv.setType(data.type().with_sizes([None, *sizes[1:]]))
        counts.setType(send_counts.type())
        return recv, counts

    def ag_symbolic(g, x):
        y = g.op(f"{DOMAIN}::AllGather", x)
        sizes = x.type().sizes()
        if sizes is not None:
            y.setType(x.type().with_sizes([dist.get_world_size(), *sizes]))
        return y

    def argsort_symbolic(g, self, *args):
        """aten::argsort(self, dim, descending) and argsort.stable(self, *, stable, dim, descending):
        the opset-11 symbolic reads ``stable`` as ``out`` and refuses; same keys as aten_sort_stable."""
        consts = [sh._maybe_get_const(a, "i") for a in args]
        dim, descending = (consts[1], consts[2]) if len(consts) == 3 else (consts[0], consts[1])
        dim, descending = int(dim), bool(descending)
        m = g.op("Gather", g.op("Shape", self), g.op("Constant", value_t=torch.tensor(dim)), axis_i=0)
        m1 = g.op("Reshape", m, g.op("Constant", value_t=torch.tensor([1])))
        if self.type().scalarType() in ("Bool", "Char", "Byte", "Short", "Int", "Long"):
            rank = len(self.type().sizes())
            axis = dim % rank
            zero, one = g.op("Constant", value_t=torch.tensor(0)), g.op("Constant", value_t=torch.tensor(1))
            iota = g.op("Range", zero, m, one)
            if axis != rank - 1:
                iota = g.op("Reshape", iota, g.op("Constant", value_t=torch.tensor([-1] + [1] * (rank - 1 - axis))))
            tie = g.op("Sub", g.op("Sub", m, one), iota) if descending else iota
            key = g.op("Add", g.op("Mul", g.op("Cast", self, to_i=7), m), tie)
            _, idx = g.op("TopK", key, m1, axis_i=dim, largest_i=int(descending), sorted_i=1, outputs=2)
        else:
            _, idx = g.op("TopK", self, m1, axis_i=dim, largest_i=int(descending), sorted_i=1, outputs=2)
        return idx

    register_custom_op_symbolic("aten::argsort", argsort_symbolic, opset)
    register_custom_op_symbolic("peers::all_to_all", a2a_symbolic, opset)
    register_custom_op_symbolic("peers::all_gather", ag_symbolic, opset)
