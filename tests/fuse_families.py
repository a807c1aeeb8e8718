"""The fuse sweep over every experts-interface family (tests/transformers_models.py FAST + SLOW):
each family's tiny model exported in the ``batched_mm`` form (torch.onnx.export, dynamo) and the
``grouped_mm`` form (transformers' OnnxExporter), run through ``fuse_moe``, and the fused model
compared with the export at sequence lengths 1, 7 and 33.

Run the whole sweep (about a minute per family and form on 2 cores)::

    python -m tests.fuse_families [FAMILY ...] [--forms batched_mm,grouped_mm] [--json OUT] [--rewrites]

and it prints one row per family and form (the table in docs/transformers.md). ``--rewrites``
exports under ``export_causal_lm``'s rewrites of the family's code (moe_onnx.transformers
EXPORT_PATCHES: the families whose own code does not export, e.g. kolibri1_1, qwen4_exp).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx

from .transformers_models import EXPERTS

FORMS = ("batched_mm", "grouped_mm")
LENGTHS = (1, 7, 33)


@dataclass
class Row:
    """One family in one form: what fuse did and how the fused model compares with the export."""

    family: str
    form: str
    layers: int = 0  # MoE layers of the model (the experts modules)
    blocks: list[str] = field(default_factory=list)  # per block: its status
    gates: list[str] = field(default_factory=list)
    routers: list[str] = field(default_factory=list)  # per fused block: the router's line
    reasons: list[str] = field(default_factory=list)  # per skipped block: its first reason
    outside: list[str] = field(default_factory=list)  # ops reading an expert weight, other than GroupedMatmul
    difference: float | None = None  # largest relative difference of the fused model, over LENGTHS
    error: str = ""  # the export or the run failed: its last line
    export_s: float = 0.0
    fuse_s: float = 0.0

    @property
    def fused(self) -> bool:
        return bool(self.blocks) and all(s == "fused" for s in self.blocks) and len(self.blocks) == self.layers


def outside_the_chain(proto: onnx.ModelProto, experts: int = EXPERTS) -> list[str]:
    """``domain::op`` of every node other than GroupedMatmul that reads an expert weight: a 3-D
    initializer of ``experts`` matrices (other 3-D constants, a convolution's or a state-space
    layer's, are not experts)."""
    weights = {i.name for i in proto.graph.initializer if len(i.dims) == 3 and i.dims[0] == experts}
    readers = {f"{n.domain}::{n.op_type}" for n in proto.graph.node if weights & set(n.input)}
    return sorted(readers - {"cann.moe::GroupedMatmul"})


def run(family: str, form: str, directory: Path, rewrites: bool = False) -> Row:
    """Export ``family`` in ``form`` (under ``export_causal_lm``'s rewrites of its code when
    ``rewrites``), fuse it, compare (the fused model in moe_onnx.InferenceSession)."""
    import onnx_ir as ir
    import onnxruntime as ort

    import moe_onnx
    from moe_onnx.converters import fuse_moe

    from .test_fuse_moe import export_batched_mm, export_grouped_mm, ids_of

    row = Row(family, form)
    source, target = directory / f"{family}_{form}.onnx", directory / f"{family}_{form}_fused.onnx"
    try:
        start = time.perf_counter()
        row.layers = (export_batched_mm if form == "batched_mm" else export_grouped_mm)(family, source, rewrites)
        row.export_s = time.perf_counter() - start
        start = time.perf_counter()
        model = ir.load(str(source))
        _, report = fuse_moe(model)
        ir.save(model, str(target))
        row.fuse_s = time.perf_counter() - start
        row.blocks = [b.status for b in report.blocks]
        row.gates = [b.gate or "" for b in report.blocks if b.status == "fused"]
        row.routers = [b.router or "" for b in report.blocks if b.status == "fused"]
        row.reasons = [b.reasons[0] if b.reasons else "" for b in report.blocks if b.status != "fused"]
        row.outside = outside_the_chain(onnx.load(target))
        original = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
        fused = moe_onnx.InferenceSession(str(target))
        worst = 0.0
        length = original.get_inputs()[0].shape[1]
        if isinstance(length, int):  # the exporter did not keep the sequence length dynamic
            row.error = f"the export's sequence length is static ({length}): compared at {length} only"
        for sequence in LENGTHS if not isinstance(length, int) else (length,):
            feeds = {"input_ids": ids_of(sequence)}
            want = original.run(None, feeds)[0]
            got = fused.run(None, feeds)[0]
            worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
        row.difference = worst
    except Exception as error:  # the sweep reports every family
        lines = traceback.format_exception_only(type(error), error)
        row.error = " ".join(lines[-1].split())[:300]
    return row


def short_router(line: str) -> str:
    if line.startswith("left as exported: "):
        return "kept: " + line[len("left as exported: ") :]
    return line.split(" (")[0]


def table(rows: list[Row]) -> str:
    """A markdown table, one row per family and form."""
    lines = [
        "| family | form | MoE layers | blocks fused | gate | router | outside the chain | max rel. diff | why not |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        done = sum(s == "fused" for s in r.blocks)
        routers = sorted({short_router(x) for x in r.routers})
        gates = sorted(set(r.gates))
        diff = "" if r.difference is None else f"{r.difference:.1e}"
        why = r.error or "; ".join(sorted(set(r.reasons)))
        lines.append(
            f"| {r.family} | {r.form} | {r.layers} | {done}/{len(r.blocks)} | {', '.join(gates)} | "
            f"{'; '.join(routers)} | {', '.join(r.outside) or '-'} | {diff} | {why} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from .transformers_models import FAST, SLOW

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", default=[*FAST, *SLOW])
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--json")
    parser.add_argument("--rewrites", action="store_true", help="export under export_causal_lm's rewrites")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for family in args.families:
            for form in args.forms.split(","):
                row = run(family, form, Path(directory), args.rewrites)
                rows.append(row)
                print(json.dumps(asdict(row)), file=sys.stderr, flush=True)
                for path in Path(directory).iterdir():
                    path.unlink() if path.is_file() else None
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
