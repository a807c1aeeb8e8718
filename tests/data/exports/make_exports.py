"""Make the corpus of real per-rank MoE-layer exports in this folder (needs the peers installed: README.md).

usage: python tests/data/exports/make_exports.py [--out DIR] [--ranks 2 4] [--layers NAME ...] [--variants NAME ...]
(naming only --layers or only --variants makes only those)

The first corpus (``--layers``, ``--ranks``): for each layer and N, N gloo processes build the
peer's layer (``layers.py``: L = 2, top-2, static token count), run it eagerly on two batches
(seed 100 + rank, the traced one; 200 + rank, the "alt" one) and export it with
``torch.onnx.export`` twice: ``dynamo=True`` with ``moe_onnx.torch.translation_table()``, and the
legacy TorchScript exporter after ``moe_onnx.torch.register_legacy_symbolics()``. Per export
directory ``<layer>_<exporter>_n<N>/``:

    rank{r}.onnx                         the rank's graph (dynamo: per-node metadata stripped)
    rank{r}_inputs.npz, rank{r}_torch_out.npz          the traced batch and the peer's output
    rank{r}_alt_inputs.npz, rank{r}_alt_torch_out.npz  another batch: does the graph hold beyond it?

The later exports (``--variants``, :data:`VARIANTS`; issue 23) vary N, L, K, the tokens per rank
(uneven) and whether the token count is a symbolic dim (``dyn``: ``dynamic_shapes`` /
``dynamic_axes``), and add DeepSpeed without dropped tokens. Directory
``<layer>_<exporter>_n<N>_l<L>_k<K>[_dyn][_host]/``, with the batches above plus ``skew_`` (every
token one row plus small noise: all route to the same experts, the largest counts a batch can
have, without ties) and,
for ``dyn`` exports, ``long_`` (twice the tokens) and ``short_`` (half); ``export.json`` records
the variant. npz keys are the graph's input / output names. Every saved graph passes
``onnx.checker`` (full) and strict shape inference. One export at a time (N processes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAYERS = ("megatron_dropless", "megatron_droppad", "fairscale_top2", "deepspeed_top2")
EXPORTERS = ("dynamo", "legacy")


@dataclass(frozen=True)
class Variant:
    """One export: a layer (``LAYERS``; later ``deepspeed_drop`` (any k) and ``deepspeed_nodrop``:
    ``drop_tokens=False``; ``deepspeed_residual`` / ``deepspeed_fp16``: the public ``MoE``; ``torchtitan``) on N ranks."""

    layer: str
    ranks: int
    exporter: str
    local_experts: int = 2
    topk: int = 2
    tokens: tuple[int, ...] = ()  # per rank; () = the first corpus' (12 Megatron, 16 the others)
    dynamic: bool = False  # the token count is a symbolic dim of the graph
    min_capacity: int = 1  # DeepSpeed
    host_splits: bool = False  # Megatron: split sizes copied to the host as on a GPU (layers.py P5)
    dtype: str = "float32"  # of the layer and its input (DeepSpeed's public MoE: "float16" too)
    extras: tuple[str, ...] = ()  # Megatron's other forms (layers.megatron): shared, groups, position, two_layers;
    # torchtitan: sigmoid (its router's score_func "sigmoid" with route_norm; else "softmax"), padded
    # (its TorchAOTokenDispatcher, pad_multiple 8)

    @property
    def name(self) -> str:
        if not self.tokens and not self.dynamic and (self.local_experts, self.topk) == (2, 2):
            return f"{self.layer}_{self.exporter}_n{self.ranks}"  # the first corpus
        return f"{self.layer}_{self.exporter}_n{self.ranks}_l{self.local_experts}_k{self.topk}" + (
            "_dyn" if self.dynamic else ""
        ) + ("_host" if self.host_splits else "") + "".join(f"_{extra}" for extra in self.extras)

    def tokens_of(self, rank: int) -> int:
        if self.tokens:
            return self.tokens[rank]
        return 12 if self.layer.startswith("megatron") else 16

    def batches(self) -> dict[str, tuple[int, bool]]:
        """batch prefix -> (token-count factor, skewed)."""
        found = {"": (1.0, False), "alt_": (1.0, False), "skew_": (1.0, True)}
        if self.name == f"{self.layer}_{self.exporter}_n{self.ranks}":
            found = {"": (1.0, False), "alt_": (1.0, False)}  # the first corpus, as saved
        if self.dynamic:
            found.update(long_=(2.0, False), short_=(0.5, False))
        return found


#: the later exports (issue 23): other N, L, K, uneven tokens per rank, symbolic token counts
VARIANTS = (
    *(
    Variant(layer, ranks, exporter, local_experts, topk, tokens, dynamic, min_capacity)
    for layer, ranks, local_experts, topk, tokens, dynamic, min_capacity, exporters in (
        ("megatron_dropless", 3, 3, 3, (10, 12, 14), False, 1, EXPORTERS),
        ("megatron_dropless", 4, 3, 1, (9, 12, 15, 12), True, 1, ("dynamo",)),
        ("megatron_droppad", 4, 3, 1, (), True, 1, ("dynamo",)),
        ("megatron_droppad", 3, 3, 3, (), False, 1, ("legacy",)),
        ("fairscale_top2", 3, 3, 2, (18,) * 3, True, 1, EXPORTERS),  # fairscale: T % L == 0
        ("fairscale_top2", 3, 3, 2, (18,) * 3, False, 1, ("legacy",)),
        ("deepspeed_drop", 4, 3, 2, (18,) * 4, True, 4, ("dynamo",)),  # min_capacity 4: C = 4 on the traced T
        ("deepspeed_drop", 3, 3, 2, (18,) * 3, False, 1, ("legacy",)),
        ("deepspeed_drop", 3, 3, 3, (18,) * 3, False, 1, ("dynamo",)),  # legacy: jit refuses its bool scatter_
        ("deepspeed_nodrop", 3, 3, 2, (18,) * 3, True, 1, ("dynamo",)),
        ("deepspeed_nodrop", 3, 3, 2, (18,) * 3, False, 1, ("legacy",)),
    )
    for exporter in exporters
    ),
    # the split sizes and the send counts both traced as constants (the legacy exporter, numpy sizes)
    Variant("megatron_dropless", 2, "legacy", 2, 2, (12, 10), host_splits=True),
    # DeepSpeed's public deepspeed.moe.layer.MoE (issue 29): with its residual MLP; in float16
    Variant("deepspeed_residual", 2, "dynamo", 2, 2, (16, 16)),
    Variant("deepspeed_fp16", 2, "dynamo", 2, 2, (16, 16), dtype="float16"),
    # megatron-core's other forms (issue 29): top-8 with a shared expert, group-limited routing,
    # the "position" drop policy, two MoE layers in one graph
    Variant("megatron_dropless", 2, "dynamo", 4, 8, (12, 10), extras=("shared",)),
    Variant("megatron_dropless", 2, "dynamo", 2, 2, (12, 10), extras=("groups",)),
    Variant("megatron_droppad", 2, "dynamo", 2, 2, (12, 12), extras=("position",)),
    Variant("megatron_dropless", 2, "dynamo", 2, 2, (12, 10), extras=("two_layers",)),
    # torchtitan 0.3.0's MoE and AllToAllTokenDispatcher (issue 29): softmax top-2, uneven tokens;
    # symbolic T on 2 and 4 ranks; sigmoid top-8 of E = 8 with route_norm (DeepSeek-V3's routing); top-1
    Variant("torchtitan", 2, "dynamo", 2, 2, (12, 10)),
    Variant("torchtitan", 2, "dynamo", 2, 2, (12, 10), dynamic=True),
    Variant("torchtitan", 4, "dynamo", 2, 2, (9, 12, 15, 12), dynamic=True),
    Variant("torchtitan", 2, "dynamo", 4, 8, (12, 10), extras=("sigmoid",)),
    Variant("torchtitan", 2, "dynamo", 2, 1, (12, 10), dynamic=True),
    # its TorchAOTokenDispatcher: each local expert's rows padded to a multiple of 8
    Variant("torchtitan", 2, "dynamo", 2, 2, (12, 10), dynamic=True, extras=("padded",)),
)


def build(variant: Variant, rank: int):
    """The layer module and its graph input name."""
    import layers

    world, experts, topk = variant.ranks, variant.local_experts, variant.topk
    if variant.layer.startswith("megatron"):
        mode = variant.layer.split("_")[1]
        return layers.megatron(rank, world, mode, experts, topk, variant.host_splits, variant.extras), "hidden"
    if variant.layer.startswith("fairscale"):
        return layers.fairscale(rank, world, experts), "input"
    if variant.layer in ("deepspeed_residual", "deepspeed_fp16"):  # the public MoE
        import torch

        dtype = getattr(torch, variant.dtype)
        residual = variant.layer == "deepspeed_residual"
        return layers.deepspeed_public_moe(rank, world, experts, topk, residual, dtype), "input"
    if variant.layer == "torchtitan":
        score_func = "sigmoid" if "sigmoid" in variant.extras else "softmax"
        pad_multiple = 8 if "padded" in variant.extras else 0
        return layers.torchtitan(rank, world, experts, topk, score_func, pad_multiple), "hidden"
    drop = variant.layer != "deepspeed_nodrop"
    return layers.deepspeed(rank, world, experts, topk, drop, variant.min_capacity), "input"


def export(module, x, path: Path, variant: Variant, input_name: str) -> None:
    import torch

    import moe_onnx.torch as mt

    if variant.exporter == "dynamo":
        translations = mt.translation_table()
        if variant.layer == "torchtitan":
            import layers

            translations |= layers.torchtitan_translations()
        dynamic_shapes = None
        if variant.dynamic:  # fairscale asserts T % L == 0: the token count is L * chunks
            multiple = variant.local_experts if variant.layer.startswith("fairscale") else 1
            tokens = torch.export.Dim("tokens", min=4, max=4096) if multiple == 1 else None
            if tokens is None:
                tokens = multiple * torch.export.Dim("chunks", min=2, max=1024)
            dynamic_shapes = (({0: tokens},),) if multiple > 1 else ({0: tokens},)  # fairscale: forward(*input)
        program = torch.onnx.export(
            module,
            (x,),
            dynamo=True,
            custom_translation_table=translations,
            input_names=[input_name],
            output_names=["output"],
            opset_version=18,
            optimize=True,
            external_data=False,
            dynamic_shapes=dynamic_shapes,
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
            dynamic_axes={input_name: {0: "tokens"}, "output": {0: "tokens"}} if variant.dynamic else None,
        )


def rank_main(rank: int, init_file: str, variants: list[Variant], out: str) -> None:
    """Every variant (one layer and N): run its batches eagerly, then export."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(HERE))
    import warnings

    import numpy as np
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    world = variants[0].ranks
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        module, input_name = build(variants[0], rank)
        tokens = variants[0].tokens_of(rank)
        batches = {}
        for prefix, (factor, skew) in variants[0].batches().items():
            seed = {"alt_": 200, "skew_": 300, "long_": 400, "short_": 500}.get(prefix, 100) + rank
            count = max(int(tokens * factor) // variants[0].local_experts, 2) * variants[0].local_experts
            count = tokens if factor == 1.0 else count
            generator = torch.Generator().manual_seed(seed)
            if skew:  # one token and small noise (no ties for the routers' top-k to break)
                base = torch.randn(1, 1, 16, generator=generator)
                batches[prefix] = base + 0.05 * torch.randn(count, 1, 16, generator=generator)
            else:
                batches[prefix] = torch.randn(count, 1, 16, generator=generator)
            batches[prefix] = batches[prefix].to(getattr(torch, variants[0].dtype))
        with torch.no_grad():
            outputs = {prefix: module(x) for prefix, x in batches.items()}
        for variant in variants:
            d = Path(out) / variant.name
            d.mkdir(parents=True, exist_ok=True)
            for prefix, x in batches.items():
                np.savez(d / f"rank{rank}_{prefix}inputs.npz", **{input_name: x.numpy()})
                np.savez(d / f"rank{rank}_{prefix}torch_out.npz", output=outputs[prefix].numpy())
            with torch.no_grad():
                export(module, batches[""], d / f"rank{rank}.onnx", variant, input_name)
            if rank == 0 and variant in VARIANTS:
                record = dataclasses.asdict(variant) | {"tokens": [variant.tokens_of(r) for r in range(world)]}
                (d / "export.json").write_text(json.dumps(record, indent=1) + "\n")
        print(json.dumps({"variants": [v.name for v in variants], "rank": rank, "status": "ok"}), flush=True)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    dist.barrier()
    dist.destroy_process_group()


def launch(variants: list[Variant], out: Path) -> None:
    """The variants of one layer, N and batches in one set of N processes (the eager runs once)."""
    import torch.multiprocessing as mp

    fd, init_file = tempfile.mkstemp(prefix="gloo_")
    os.close(fd)
    os.unlink(init_file)
    mp.start_processes(
        rank_main, args=(init_file, variants, str(out)), nprocs=variants[0].ranks, start_method="spawn", join=True
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
    for name in ("torch", "megatron-core", "fairscale", "deepspeed", "torchtitan", "onnx", "onnxscript", "moe-onnx"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "-"
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", nargs="*", choices=LAYERS, help="the first corpus (default: all)")
    names = [v.name for v in VARIANTS]
    parser.add_argument("--variants", nargs="*", choices=names, metavar="NAME", help="the later exports (default: all)")
    args = parser.parse_args()
    if args.layers is None and args.variants is None:  # neither named: everything
        args.layers, args.variants = list(LAYERS), names
    args.layers, args.variants = args.layers or [], args.variants or []
    jobs: dict[tuple, list[Variant]] = {}
    for world in args.ranks:
        for layer in args.layers:
            jobs[(layer, world)] = [Variant(layer, world, exporter) for exporter in EXPORTERS]
    for variant in VARIANTS:
        if variant.name in args.variants:  # the same layer, sizes and batches: one eager run
            key = dataclasses.astuple(dataclasses.replace(variant, exporter=""))
            jobs.setdefault(key, []).append(variant)
    for variants in jobs.values():
        launch(variants, args.out)
        for variant in variants:
            for rank in range(variant.ranks):
                finish(args.out / variant.name / f"rank{rank}.onnx")
    print(json.dumps(versions()))


if __name__ == "__main__":
    main()
