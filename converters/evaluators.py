"""``onnx.reference`` as the converter uses it: every probe and mirror-world evaluation goes through
:func:`reference_evaluator`, which mends what onnx.reference gets wrong for graphs exporters write.

* ``Loop`` with its optional ``cond`` input left empty runs no iteration in onnx.reference
  (``while cond and ...`` on None); the ONNX spec reads an empty ``cond`` as true (the legacy
  exporter's ``repeat_interleave`` loops are written so).
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


def reference_evaluator(model: onnx.ModelProto, new_ops: list[type] | None = None):
    """``onnx.reference.ReferenceEvaluator(model)`` with the fixes above (and ``new_ops``)."""
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model, new_ops=[_loop_class(), *(new_ops or [])])


__all__ = ["reference_evaluator"]
