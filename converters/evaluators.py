"""``onnx.reference`` as the converter uses it: every probe and mirror-world evaluation goes through
:func:`reference_evaluator`, which mends what onnx.reference gets wrong for graphs exporters write.

* ``Loop`` with its optional ``cond`` input left empty runs no iteration in onnx.reference
  (``while cond and ...`` on None); the ONNX spec reads an empty ``cond`` as true (the legacy
  exporter's ``repeat_interleave`` loops are written so).
* ``GatherElements`` picks with ``np.choose``, which takes at most 64 choices; its fallback for
  more keeps one index per row (a router's top-8 of 256 experts failed): replaced by
  :func:`gather_elements`.
* ``CumSum`` refuses an ``axis`` of shape ``[1]``, which onnxruntime takes and the dynamo
  exporter writes (torchtitan's ``cumsum`` of the received counts): read as its one element.
"""

from __future__ import annotations

import numpy as np
import onnx


def _loop_class():
    from onnx.reference.ops.op_loop import Loop

    class LoopEmptyCondition(Loop):
        """The standard Loop, an empty ``cond`` read as true (ONNX's Loop, "cond" input)."""

        op_domain = ""

        def _run(self, M, cond, *args, context=None, body=None, attributes=None, bindings=None):  # noqa: N803 (ONNX's name)
            if cond is None:
                cond = np.array(True)
            return super()._run(M, cond, *args, context=context, body=body, attributes=attributes, bindings=bindings)

    LoopEmptyCondition.__name__ = "Loop"
    return LoopEmptyCondition


def gather_elements(data: np.ndarray, indices: np.ndarray, axis: int = 0) -> np.ndarray:
    """ONNX GatherElements: ``out[i][j] = data[indices[i][j]][j]`` (axis 0; likewise on any
    axis), ``out`` shaped as ``indices``, whose other dims may be shorter than ``data``'s."""
    axis = axis % data.ndim
    index = np.where(indices < 0, indices + data.shape[axis], indices)
    window = tuple(slice(None) if d == axis else slice(0, n) for d, n in enumerate(index.shape))
    return np.take_along_axis(data[window], index, axis)


def _gather_elements_class():
    from onnx.reference.op_run import OpRun

    def run(self, data, indices, axis=0):
        return (gather_elements(data, indices, axis),)

    return type("GatherElements", (OpRun,), {"op_domain": "", "_run": run})


def _cum_sum_class():
    from onnx.reference.ops.op_cum_sum import CumSum

    class CumSumAxisOfOne(CumSum):
        """The standard CumSum, a one-element ``axis`` read as its scalar (as onnxruntime does)."""

        op_domain = ""

        def _run(self, x, axis, exclusive=None, reverse=None):
            axis = np.asarray(axis)
            if axis.shape == (1,):
                axis = axis.reshape(())
            return super()._run(x, axis, exclusive=exclusive, reverse=reverse)

    CumSumAxisOfOne.__name__ = "CumSum"
    return CumSumAxisOfOne


def reference_evaluator(model: onnx.ModelProto, new_ops: list[type] | None = None):
    """``onnx.reference.ReferenceEvaluator(model)`` with the fixes above (and ``new_ops``)."""
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(
        model, new_ops=[_loop_class(), _gather_elements_class(), _cum_sum_class(), *(new_ops or [])]
    )


__all__ = ["gather_elements", "reference_evaluator"]
