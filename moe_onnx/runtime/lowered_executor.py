"""The lowered executor: our ops as their standard-ONNX bodies, run by onnxruntime itself.

The model is lowered with :func:`moe_onnx.lower` (``inline=True``): every ``cann.moe`` op but
the collectives becomes standard ops, which onnxruntime runs in its own sessions; only the
collectives (AllToAll, AllGather) remain kernel calls, through the split executor. What the
kernels refuse, a lowered body makes fail at run time (docs/lowering.md); such a failure is
raised as the :class:`MoeOpError` its check names. Sums are within float32 accumulation
error of the kernels', not their bits.
"""

from __future__ import annotations

import re

import onnx

from ..converters import lower
from ..custom_ops import MoeOpError
from .split import SplitExecutor

#: onnxruntime's message for a failed check node of a lowered body (named "<node>/<Op> check: <rule>")
_FAILED_CHECK = re.compile(r"Name:'(?P<node>[^']*)/(?P<op>\w+) check: (?P<rule>[^']*)'")


class LoweredExecutor(SplitExecutor):
    """:class:`~moe_onnx.runtime.split.SplitExecutor` over the inline-lowered model."""

    def __init__(self, model: onnx.ModelProto, base_dir: str | None, sess_options, providers, context, **kwargs):
        super().__init__(lower(model, inline=True), base_dir, sess_options, providers, context, **kwargs)

    def run(self, output_names, feeds, run_options=None):
        try:
            return super().run(output_names, feeds, run_options)
        except MoeOpError:
            raise
        except Exception as exc:  # onnxruntime's Fail: a lowered body's check, or anything else
            failed = _FAILED_CHECK.search(str(exc))
            if failed is None:
                raise
            raise MoeOpError(failed["rule"], op_type=failed["op"], node_name=failed["node"]) from exc
