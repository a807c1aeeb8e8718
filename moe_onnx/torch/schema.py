"""An operator's torch-side signature, derived from its :class:`OpDef` (never restated by hand).

ONNX inputs become positional tensor arguments (optional ones default to None), ONNX
attributes keyword-only arguments with the schema's names and defaults, and every ONNX output
a returned tensor in schema order (an absent optional output is an empty placeholder inside
the torch op; the public functions turn it into None).
"""

from __future__ import annotations

import inspect

from ..custom_ops.opdef import Attr, OpDef, snake_case

NAMESPACE = "cann_moe"

_TORCH_ATTR_TYPES = {"int": "int", "ints": "int[]", "float": "float", "string": "str"}


def _attr_argument(attr: Attr) -> str:
    kind = _TORCH_ATTR_TYPES[attr.kind]
    if attr.default is None:
        return f"{kind} {attr.name}" if attr.required else f"{kind}? {attr.name}=None"
    default = attr.default
    if attr.kind == "ints":
        default = "[" + ", ".join(map(str, default)) + "]"
    elif attr.kind == "string":
        default = f'"{default}"'
    return f"{kind} {attr.name}={default}"


def defaults_to_none(op: OpDef) -> list[bool]:
    """Per input: may it be left out? Optional inputs default to None unless a required input
    follows (then the caller passes None, as in torch_npu's grad functions)."""
    required_after = [any(not j.optional for j in op.inputs[k + 1 :]) for k in range(len(op.inputs))]
    return [i.optional and not later for i, later in zip(op.inputs, required_after)]


def torch_schema(op: OpDef) -> str:
    """The ``torch.library`` schema of ``op``, e.g.
    ``(Tensor x, Tensor? probs=None, *, int num_out_tokens, int drop_and_pad=0) -> (Tensor, Tensor, Tensor)``."""
    arguments = [
        f"Tensor? {i.name}" + ("=None" if default else "") if i.optional else f"Tensor {i.name}"
        for i, default in zip(op.inputs, defaults_to_none(op))
    ]
    if op.attrs:
        arguments += ["*"] + [_attr_argument(a) for a in op.attrs]
    returns = "Tensor" if len(op.outputs) == 1 else "(" + ", ".join("Tensor" for _ in op.outputs) + ")"
    return f"({', '.join(arguments)}) -> {returns}"


def python_signature(op: OpDef) -> inspect.Signature:
    """The public function's signature: inputs positional, attributes keyword-only."""
    parameters = [
        inspect.Parameter(
            i.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None if default else inspect.Parameter.empty
        )
        for i, default in zip(op.inputs, defaults_to_none(op))
    ]
    parameters += [
        inspect.Parameter(
            a.name, inspect.Parameter.KEYWORD_ONLY, default=inspect.Parameter.empty if a.required else a.default
        )
        for a in op.attrs
    ]
    return inspect.Signature(parameters)


def docstring(op: OpDef) -> str:
    """The public function's docstring, from the OpDef's own words."""
    lines = [f"``cann.moe::{op.name}`` as a torch op (``torch.ops.{NAMESPACE}.{snake_case(op.name)}``).", ""]
    lines += ["Args:"]
    lines += [f"    {i.name}: {i.doc} ({', '.join(i.dtypes)}{'; optional' if i.optional else ''})" for i in op.inputs]
    lines += [f"    {a.name}: {a.doc} (default {a.default!r})" for a in op.attrs]
    lines += ["Returns:"]
    lines += [f"    {o.name}: {o.doc}{' (None when absent)' if o.optional else ''}" for o in op.outputs]
    lines += ["", op.doc.strip()]
    return "\n".join(lines)
