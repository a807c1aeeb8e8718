"""One transformers MoE block, every way it reaches onnxruntime CPU, side by side in one process:

* ``fused``: the ``batched_mm`` export after ``fuse_moe`` (the cann.moe chain), run by
  ``moe_onnx.InferenceSession``; the first path, every ratio is to it;
* ``fused grouped``: the ``grouped_mm`` export after ``fuse_moe``, likewise;
* ``fused, lowered``: ``fused``'s model lowered to standard ONNX (``moe_onnx.lower(inline=True)``:
  one packed ``Gemm`` weight per expert), run by stock onnxruntime;
* ``batched_mm``: transformers' batched_mm experts exported by ``torch.onnx.export`` (dynamo),
  run by onnxruntime; not run where its gather of every row's expert weights would take more
  than :data:`MAX_GATHER_BYTES` (the row says so and why);
* ``grouped_mm``: transformers' default experts, exported with transformers' own translation
  table (the only export of grouped_mm: per expert a Gather of its rows and a MatMul), run by
  onnxruntime;
* ``cann export``: the block with the "cann" experts implementation (router as a gating op
  too) exported by ``moe_onnx.torch.export``, run by ``moe_onnx.InferenceSession``;
* ``ort MoE``: ``com.microsoft::MoE`` (:func:`bench_layer_e2e.ort_moe_model`) behind the
  block's router MatMul, where it can express the block: softmax top-k routing (renormalised or
  not), SwiGLU, no shared expert; otherwise the row says what it cannot express.

    python -m moe_onnx.benchmarks.bench_transformers [--tokens 16 128 512] [--shapes mixtral qwen3 deepseek]
        [--repeats 9] [--cold] [--markdown OUT]

Shapes are the families' ratios scaled down to fit a shared machine (``SHAPES``). Every path's
output is compared with the fused one's before timing (largest relative difference reported).
The paths run in turn, round after round (``harness.interleaved_seconds``); each ratio is the
median of its per-round ratios to ``fused``, so read the ratios, not the absolute times. Each
timed call is a path's steady state, as a loop over the block (a decode) sees it: the process
first sleeps ``harness.STEADY_SETTLE_SECONDS`` (onnxruntime's idle pool threads spin ~25 ms
after a run, measured here: 27 ms of CPU in the 50 ms after a call, and would take a core from
whichever path runs next), then makes ``harness.STEADY_LEAD`` untimed calls of the same path
(``harness.steady_seconds``; its threads awake, onnxruntime's spinning as between a model's
nodes). Every onnxruntime session keeps its default options. ``--cold`` times the first call
after the sleep instead: every thread idle, the weights out of the caches (the other paths'
weights passed through them).
"""

from __future__ import annotations

import argparse
import functools
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .harness import STEADY_LEAD, steady_seconds

#: (config class, overrides): hidden / expert width / experts / top-k in each family's ratios, scaled down
SHAPES = {
    "mixtral": ("MixtralConfig", {"hidden_size": 1024, "intermediate_size": 2048, "num_local_experts": 8,
                                  "num_experts_per_tok": 2}),
    "qwen3": ("Qwen3MoeConfig", {"hidden_size": 512, "moe_intermediate_size": 192, "num_experts": 128,
                                 "num_experts_per_tok": 8, "norm_topk_prob": True}),
    "deepseek": ("DeepseekV3Config", {"hidden_size": 512, "moe_intermediate_size": 128, "n_routed_experts": 256,
                                      "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
                                      "first_k_dense_replace": 0, "n_shared_experts": 1}),
    "tiny": ("MixtralConfig", {"hidden_size": 32, "intermediate_size": 48, "num_local_experts": 8,
                               "num_experts_per_tok": 2}),
}  # fmt: skip
DEFAULT_SHAPES = ("mixtral", "qwen3", "deepseek")
#: the batched_mm export gathers every (token, slot) row's expert weights: not run above this
MAX_GATHER_BYTES = 8 << 30
#: the largest relative difference from the fused block a timed path may have (float32)
MAX_DIFFERENCE = 1e-4
PATHS = ("fused", "fused grouped", "fused, lowered", "batched_mm", "grouped_mm", "cann export", "ort MoE")


def block(shape: str, implementation: str):
    """The MoE block of a one-layer model of ``shape``, its experts set to ``implementation``."""
    import torch
    import transformers

    class_name, overrides = SHAPES[shape]
    config = getattr(transformers, class_name)(num_hidden_layers=1, num_attention_heads=4, **overrides)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if implementation == "cann":
        import moe_onnx.transformers as mtf

        mtf.use_cann(model)  # the router as a gating op too
    else:
        model.set_experts_implementation(implementation)
    return model.model.layers[0].mlp


def export(module, path: Path, how: str) -> None:
    """``how``: "cann" (moe_onnx.torch.export), "grouped_mm" (torch.onnx.export with
    transformers' translation table and export patches) or "batched_mm" (torch.onnx.export)."""
    import torch

    x = torch.randn(1, 16, module.experts.gate_up_proj.shape[-1])
    dims = {"hidden_states": {1: torch.export.Dim("tokens", min=1, max=4096)}}
    with torch.no_grad():
        if how == "cann":
            import moe_onnx.torch as mt

            mt.export(module, (x,), path, dynamic_shapes=dims)
            return
        if how == "grouped_mm":
            from transformers.exporters.exporter_onnx import _ONNX_TRANSLATION_TABLE
            from transformers.exporters.utils import apply_patches

            with apply_patches("onnx"):
                program = torch.onnx.export(
                    module,
                    (x,),
                    dynamo=True,
                    dynamic_shapes=dims,
                    custom_translation_table=_ONNX_TRANSLATION_TABLE,
                    verbose=False,
                )
        else:
            program = torch.onnx.export(module, (x,), dynamo=True, dynamic_shapes=dims, verbose=False)
        assert program is not None  # dynamo=True returns the program
        program.save(str(path))


def ort_moe_block(module) -> tuple[object | None, str]:
    """``(model, "")``: ``com.microsoft::MoE`` behind the block's router MatMul, x and y as the
    block's ``[1, T, H]``; or ``(None, why)`` where MoE cannot express the block."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from .bench_layer_e2e import interleaved, ort_moe_model
    from .presets import LayerShape

    experts, router = module.experts, getattr(module, "gate", None)
    if any(hasattr(module, name) for name in ("shared_experts", "shared_expert")):
        return None, "a shared expert"
    if router is None or type(router).__name__.endswith(("TopkRouter", "TopKRouter")) and hasattr(router, "n_group"):
        return None, "grouped sigmoid routing with a bias"
    if experts.has_bias or experts.is_transposed or not experts.has_gate:
        return None, "biases, [E, H, I] weights or a gateless activation"
    e, two_i, h = experts.gate_up_proj.shape
    top_k = int(getattr(router, "top_k", 0))
    normalize = bool(getattr(router, "norm_topk_prob", True))  # Mixtral renormalises; Qwen3 by its config
    model = ort_moe_model(LayerShape("block", h, two_i // 2, e, top_k, ""), normalize=normalize)
    graph = model.graph
    weights = {
        "fc1": interleaved(experts.gate_up_proj.detach().numpy()),
        "w2": experts.down_proj.detach().numpy(),
        "router": router.weight.detach().numpy(),
        "flat": np.array([-1, h], np.int64),
    }
    graph.initializer.extend(numpy_helper.from_array(np.ascontiguousarray(v), k) for k, v in weights.items())
    kept = [i for i in graph.input if i.name not in ("x", "logits", "fc1", "w2")]
    del graph.input[:]
    graph.input.extend([helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, [1, "T", h]), *kept])
    graph.output[0].CopyFrom(helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, "T", h]))
    graph.node.insert(0, helper.make_node("Reshape", ["hidden_states", "flat"], ["x"]))
    graph.node.insert(1, helper.make_node("Gemm", ["x", "router"], ["logits"], transB=1))
    graph.node.append(helper.make_node("Shape", ["hidden_states"], ["shape"]))
    graph.node.append(helper.make_node("Reshape", ["y", "shape"], ["out"]))
    onnx.checker.check_model(model)
    return model, ""


def gathered_bytes(module, tokens: int) -> int:
    """What the batched_mm export's gathers of every row's up and down weights take."""
    experts = module.experts
    per_row = experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()
    top_k = int(getattr(module.gate, "top_k", 0) or getattr(module, "top_k", 0))
    return 4 * tokens * top_k * per_row


class BlockBench:
    """One shape's exports and sessions."""

    def __init__(self, shape: str, folder: Path):
        import onnx_ir as ir
        import onnxruntime as ort

        import moe_onnx
        from moe_onnx.commands.lower_file import lower_file
        from moe_onnx.converters import fuse_moe

        self.shape = shape
        ort_run = lambda path: ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run  # noqa: E731
        self.runs: dict[str, Callable] = {}
        self.reports: dict[str, str] = {}
        self.skipped: dict[str, str] = {}
        for form in ("batched_mm", "grouped_mm"):
            module = block(shape, form)
            exported, fused = folder / f"{shape}_{form}.onnx", folder / f"{shape}_{form}_fused.onnx"
            export(module, exported, form)
            model = ir.load(str(exported))
            _, report = fuse_moe(model)
            self.reports[form] = str(report)
            if not report.changed:
                raise RuntimeError(f"{shape}: fuse left the {form} export as it was:\n{report}")
            ir.save(model, str(fused))
            self.runs[form] = ort_run(exported)
            self.runs["fused" if form == "batched_mm" else "fused grouped"] = moe_onnx.InferenceSession(str(fused)).run
            if form == "batched_mm":
                lowered = folder / f"{shape}_{form}_fused_lowered.onnx"
                lower_file(str(fused), str(lowered), inline=True)
                self.runs["fused, lowered"] = ort_run(lowered)
        self.module = module
        cann = folder / f"{shape}_cann.onnx"
        export(block(shape, "cann"), cann, "cann")
        self.runs["cann export"] = moe_onnx.InferenceSession(str(cann)).run
        moe, why = ort_moe_block(module)
        if moe is None:
            self.skipped["ort MoE"] = f"cannot express {why}"
        else:
            self.runs["ort MoE"] = ort.InferenceSession(moe.SerializeToString(), providers=["CPUExecutionProvider"]).run  # type: ignore[attr-defined]
        self.hidden = int(module.experts.gate_up_proj.shape[-1])

    def row(self, tokens: int, repeats: int, cold: bool = False) -> dict:
        """Medians (ms), ratios to ``fused`` and the largest relative difference of every path."""
        x = np.random.default_rng(tokens).standard_normal((1, tokens, self.hidden)).astype(np.float32)
        feeds = {"hidden_states": x}
        row: dict = {"shape": self.shape, "tokens": tokens, "skipped": dict(self.skipped)}
        gather = gathered_bytes(self.module, tokens)
        paths = {name: self.runs[name] for name in PATHS if name in self.runs}
        if gather > MAX_GATHER_BYTES:
            gib = gather / (1 << 30)
            row["skipped"]["batched_mm"] = f"not run: its gathers of each row's weights take {gib:.1f} GiB"
            del paths["batched_mm"]
        want = paths["fused"](None, feeds)[0]
        row["difference"] = {
            name: float(np.abs(run(None, feeds)[0] - want).max() / np.abs(want).max()) for name, run in paths.items()
        }
        wrong = {k: v for k, v in row["difference"].items() if not v <= MAX_DIFFERENCE}
        if wrong:
            raise RuntimeError(f"{self.shape} T={tokens}: these paths compute something else: {wrong}")
        calls: dict[str, Callable[[], object]] = {k: functools.partial(r, None, feeds) for k, r in paths.items()}
        medians, ratios = steady_seconds(calls, repeats, lead=0 if cold else STEADY_LEAD)
        row["ms"] = {k: 1e3 * v for k, v in medians.items()}
        row["to fused"] = ratios
        return row


def markdown_table(rows: list[dict]) -> str:
    """ms per path, then each path's time over the fused block's (x: ratio; -: not run)."""
    head = "| shape | T | " + " | ".join(PATHS) + " | " + " | ".join(f"{p} / fused" for p in PATHS[1:]) + " |"
    lines = [head, "|" + "---|" * (2 + 2 * len(PATHS) - 1)]
    for r in rows:
        ms = [f"{r['ms'][p]:.1f}" if p in r["ms"] else "-" for p in PATHS]
        ratio = [f"{r['to fused'][p]:.2f}" if p in r["to fused"] else "-" for p in PATHS[1:]]
        lines.append(f"| {r['shape']} | {r['tokens']} | " + " | ".join(ms + ratio) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 128, 512])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(DEFAULT_SHAPES))
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--cold", action="store_true", help="time each path's first call after the sleep")
    parser.add_argument("--markdown", help="write the table here too")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for shape in args.shapes:
            bench = BlockBench(shape, Path(folder))
            for form, report in bench.reports.items():
                print(f"{shape} {form}: {report.splitlines()[0]}")
            for t in args.tokens:
                row = bench.row(t, args.repeats, args.cold)
                rows.append(row)
                print(
                    f"{shape:9} T={t:4}  "
                    + "  ".join(f"{k} {v:.1f} ms" for k, v in row["ms"].items())
                    + f"  | differences {max(row['difference'].values()):.1e}"
                    + "".join(f"  | {k}: {v}" for k, v in row["skipped"].items()),
                    flush=True,
                )
            del bench
    table = markdown_table(rows)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n", encoding="utf-8")
    return rows


if __name__ == "__main__":
    main()
