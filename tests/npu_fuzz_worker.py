"""The hostile-argument fuzz of every served name (run in a subprocess by tests/test_npu_fuzz.py,
so an abort is seen as one): each argument of one valid call (tests/npu_calls.py) replaced in
turn by values a confused caller passes. Prints one JSON line: the counts of each outcome and
the first few calls of each bad outcome."""

from __future__ import annotations

import json
import sys

import torch

from moe_onnx import MoeOpError
from moe_onnx.torch import npu, ops_transformer
from tests.npu_calls import calls, tensors_of

API = {**{n: "torch_npu." for n in npu.NAMES}, **{n: "cann_ops_transformer." for n in ops_transformer.NAMES}}
NAMES = {**npu.NAMES, **ops_transformer.NAMES}


def hostile(value) -> list[tuple[str, object]]:
    """(label, replacement) for one argument's valid ``value``."""
    out: list[tuple[str, object]] = [("None", None), ("string", "x"), ("device", torch.device("cpu"))]
    if isinstance(value, torch.Tensor):
        out += [
            ("meta", value.to("meta")),
            ("complex", torch.zeros(value.shape, dtype=torch.complex64)),
            ("float64", value.to(torch.float64)),
            ("int8", value.to(torch.int8)),
            ("0-dim", torch.tensor(1.0)),
            ("list", [value]),
        ]
    elif isinstance(value, bool):
        out += [("lossy", 0.5), ("int 2", 2)]
    elif isinstance(value, int):
        out += [("lossy", value + 0.5), ("negative", -7), ("huge", 2**40), ("tensor", torch.tensor(value))]
    elif isinstance(value, (list, tuple)):
        out += [("empty", []), ("longer", list(value) + list(value[:1])), ("one", list(value[:1]))]
        if value and isinstance(value[0], torch.Tensor):
            out += [("meta items", [v.to("meta") for v in value]), ("non-tensor items", [1.0] * len(value))]
    elif isinstance(value, torch.dtype):
        out += [("complex dtype", torch.complex64)]
    return out


def outcome(name: str, args: tuple, kwargs: dict) -> str:
    try:
        result = NAMES[name](*args, **kwargs)
    except MoeOpError as err:
        return "refused" if (API[name] + name) in str(err) else "refused without the name"
    except Exception as err:  # noqa: BLE001 - the fuzz classifies every ending
        return "refused" if (API[name] + name) in str(err) else f"bare {type(err).__name__}"
    if any(t.device.type != "cpu" for t in tensors_of(result)):
        return "unwritten output"
    return "ran"


def main() -> None:
    counts: dict[str, int] = {}
    examples: dict[str, list[str]] = {}
    for name, (args, kwargs) in calls().items():
        slots = [("arg", i) for i in range(len(args))] + [("kw", k) for k in kwargs]
        for kind, key in slots:
            value = args[key] if kind == "arg" else kwargs[key]
            for label, replacement in hostile(value):
                a, k = list(args), dict(kwargs)
                if kind == "arg":
                    a[key] = replacement
                else:
                    k[key] = replacement
                result = outcome(name, tuple(a), k)
                counts[result] = counts.get(result, 0) + 1
                if result not in ("ran", "refused"):
                    examples.setdefault(result, []).append(f"{name} {kind} {key}: {label}")
    print(json.dumps({"counts": counts, "examples": {k: v[:20] for k, v in examples.items()}}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
