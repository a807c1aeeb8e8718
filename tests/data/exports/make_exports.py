"""Make the corpus of real per-rank MoE-layer exports in this folder (needs the peers installed: README.md).

usage: python tests/data/exports/make_exports.py [--out DIR] [--ranks 2 4] [--layers NAME ...]

For each layer and N, N gloo processes build the peer's layer (``layers.py``), run it eagerly on
two batches (seed 100 + rank, the traced one; 200 + rank, the "alt" one) and export it with
``torch.onnx.export`` twice: ``dynamo=True`` with ``moe_onnx.torch.translation_table()``, and the
legacy TorchScript exporter after ``moe_onnx.torch.register_legacy_symbolics()``. Per export
directory ``<layer>_<exporter>_n<N>/``:

    rank{r}.onnx                         the rank's graph (dynamo: per-node metadata stripped)
    rank{r}_inputs.npz, rank{r}_torch_out.npz          the traced batch and the peer's output
    rank{r}_alt_inputs.npz, rank{r}_alt_torch_out.npz  another batch: does the graph hold beyond it?

npz keys are the graph's input / output names. Every saved graph passes ``onnx.checker``
(full) and strict shape inference. One layer at a time (N processes); about 3 minutes in all.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAYERS = ("megatron_dropless", "megatron_droppad", "fairscale_top2", "deepspeed_top2")
EXPORTERS = ("dynamo", "legacy")


def build(layer: str, rank: int, world: int):
    """The layer module and its graph input name."""
    import layers

    if layer.startswith("megatron"):
        return layers.megatron(rank, world, layer.split("_")[1]), "hidden", layers.TOKENS["megatron"]
    peer = layer.split("_")[0]
    return getattr(layers, peer)(rank, world), "input", layers.TOKENS[peer]


def export(module, x, path: Path, dynamo: bool, input_name: str) -> None:
    import torch

    import moe_onnx.torch as mt

    if dynamo:
        program = torch.onnx.export(
            module,
            (x,),
            dynamo=True,
            custom_translation_table=mt.translation_table(),
            input_names=[input_name],
            output_names=["output"],
            opset_version=18,
            optimize=True,
            external_data=False,
        )
        program.save(str(path), external_data=False)
    else:
        mt.register_legacy_symbolics()
        torch.onnx.export(
            module,
            (x,),
            str(path),
            dynamo=False,
            input_names=[input_name],
            output_names=["output"],
            opset_version=17,
            custom_opsets={"cann.moe": 1},
        )


def rank_main(rank: int, world: int, init_file: str, layer: str, out: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(HERE))
    import warnings

    import numpy as np
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        module, input_name, tokens = build(layer, rank, world)
        batches = {
            prefix: torch.randn(tokens, 1, 16, generator=torch.Generator().manual_seed(seed + rank))
            for prefix, seed in (("", 100), ("alt_", 200))
        }
        with torch.no_grad():
            outputs = {prefix: module(x) for prefix, x in batches.items()}
        for exporter in EXPORTERS:
            d = Path(out) / f"{layer}_{exporter}_n{world}"
            d.mkdir(parents=True, exist_ok=True)
            for prefix, x in batches.items():
                np.savez(d / f"rank{rank}_{prefix}inputs.npz", **{input_name: x.numpy()})
                np.savez(d / f"rank{rank}_{prefix}torch_out.npz", output=outputs[prefix].numpy())
            with torch.no_grad():
                export(module, batches[""], d / f"rank{rank}.onnx", exporter == "dynamo", input_name)
        print(json.dumps({"layer": layer, "rank": rank, "world": world, "status": "ok"}), flush=True)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    dist.barrier()
    dist.destroy_process_group()


def launch(layer: str, world: int, out: Path) -> None:
    import torch.multiprocessing as mp

    fd, init_file = tempfile.mkstemp(prefix="gloo_")
    os.close(fd)
    os.unlink(init_file)
    mp.start_processes(
        rank_main, args=(world, init_file, layer, str(out)), nprocs=world, start_method="spawn", join=True
    )


def finish(path: Path) -> None:
    """Strip the dynamo exporter's per-node metadata (stack traces: ~5x the graph), then check."""
    import onnx

    model = onnx.load(path)
    for node in model.graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
    for value in (*model.graph.value_info, *model.graph.input, *model.graph.output, *model.graph.initializer):
        del value.metadata_props[:]
    onnx.save(model, path)
    onnx.checker.check_model(model, full_check=True)
    onnx.shape_inference.infer_shapes(model, strict_mode=True)


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "megatron-core", "fairscale", "deepspeed", "onnx", "onnxscript", "moe-onnx"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "-"
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", nargs="+", default=list(LAYERS), choices=LAYERS)
    args = parser.parse_args()
    for world in args.ranks:
        for layer in args.layers:
            launch(layer, world, args.out)
            for exporter in EXPORTERS:
                for rank in range(world):
                    finish(args.out / f"{layer}_{exporter}_n{world}" / f"rank{rank}.onnx")
    print(json.dumps(versions()))


if __name__ == "__main__":
    main()
