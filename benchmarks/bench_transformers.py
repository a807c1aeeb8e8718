"""One transformers MoE block, three ways, side by side in one process on onnxruntime CPU:

* ``batched_mm``: transformers' batched_mm experts exported by torch.onnx.export (dynamo),
  run by onnxruntime;
* ``fused``: that export after ``fuse_moe`` (the cann.moe chain), run by
  ``moe_onnx.InferenceSession``;
* ``cann export``: the block with the "cann" experts implementation exported by
  ``moe_onnx.torch.export``, run by ``moe_onnx.InferenceSession``.

    python -m moe_onnx.benchmarks.bench_transformers [--tokens 16 128 512] [--shapes mixtral qwen3 deepseek]

Shapes are the families' ratios scaled down to fit a shared machine (``SHAPES``). Reports
the median of ``--repeats`` calls per (shape, T, way), in ms, and the speedup of ``fused``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

#: (config class, overrides): hidden / expert width / experts / top-k in each family's ratios, scaled down
SHAPES = {
    "mixtral": ("MixtralConfig", {"hidden_size": 1024, "intermediate_size": 2048, "num_local_experts": 8,
                                  "num_experts_per_tok": 2}),
    "qwen3": ("Qwen3MoeConfig", {"hidden_size": 512, "moe_intermediate_size": 192, "num_experts": 128,
                                 "num_experts_per_tok": 8, "norm_topk_prob": True}),
    "deepseek": ("DeepseekV3Config", {"hidden_size": 512, "moe_intermediate_size": 128, "n_routed_experts": 256,
                                      "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
                                      "first_k_dense_replace": 0, "n_shared_experts": 1}),
}  # fmt: skip


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


def export(module, path: Path, cann: bool) -> None:
    import torch

    x = torch.randn(1, 16, module.experts.gate_up_proj.shape[-1])
    dims = {"hidden_states": {1: torch.export.Dim("tokens", min=1, max=4096)}}
    with torch.no_grad():
        if cann:
            import moe_onnx.torch as mt

            mt.export(module, (x,), path, dynamic_shapes=dims)
        else:
            program = torch.onnx.export(module, (x,), dynamo=True, dynamic_shapes=dims, verbose=False)
            assert program is not None  # dynamo=True returns the program
            program.save(str(path))


def median_ms(run, feeds: dict, repeats: int) -> float:
    run(None, feeds)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(None, feeds)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def bench_shape(shape: str, tokens: list[int], repeats: int, folder: Path) -> list[dict]:
    import onnx_ir as ir
    import onnxruntime as ort

    import moe_onnx
    from moe_onnx.converters import fuse_moe

    exported, fused, cann = folder / f"{shape}_bmm.onnx", folder / f"{shape}_fused.onnx", folder / f"{shape}_cann.onnx"
    export(block(shape, "batched_mm"), exported, cann=False)
    model = ir.load(str(exported))
    _, report = fuse_moe(model)
    assert report.changed, str(report)
    ir.save(model, str(fused))
    experts = block(shape, "cann")
    export(experts, cann, cann=True)
    sessions = {
        "batched_mm": ort.InferenceSession(str(exported), providers=["CPUExecutionProvider"]).run,
        "fused": moe_onnx.InferenceSession(str(fused)).run,
        "cann export": moe_onnx.InferenceSession(str(cann)).run,
    }
    rows = []
    hidden = experts.experts.gate_up_proj.shape[-1]
    for t in tokens:
        x = np.random.default_rng(t).standard_normal((1, t, hidden)).astype(np.float32)
        row: dict = {"shape": shape, "tokens": t}
        for name, run in sessions.items():
            row[name] = median_ms(run, {"hidden_states": x}, repeats)
        row["speedup"] = row["batched_mm"] / row["fused"]
        rows.append(row)
        print(
            f"{shape:9} T={t:4}  " + "  ".join(f"{k} {row[k]:8.2f} ms" for k in sessions) + f"  x{row['speedup']:.1f}"
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 128, 512])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        for shape in args.shapes:
            bench_shape(shape, args.tokens, args.repeats, Path(folder))


if __name__ == "__main__":
    main()
