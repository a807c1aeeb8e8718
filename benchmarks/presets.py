"""The shapes ``moe-onnx bench`` runs, and what each costs (light: the CLI's help reads it).

Each preset is one MoE layer's shape: T tokens, H hidden, E experts, top-K. Every case of a
preset is one op call at that shape (benchmarks/suite.py builds them). The default run is
the presets that fit in a few GB; the two big ones are opt-in (``--shape NAME`` or
``--shape all``), and every case is also checked against ``MOE_ONNX_MAX_BYTES`` before it
runs (:func:`benchmarks.suite.estimated_peak_bytes`). The costs below were measured on a
2-core machine (peak: resident set of the whole process, sampled every 0.2 s; time: one
run with ``--repeats 5``, the stock path included, on a quiet machine).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    name: str
    tokens: int  # T
    hidden: int  # H
    experts: int  # E
    top_k: int  # K
    about: str  # what it is and what a run of it costs


#: the seed's rerouting call (SPEC 1.1): 16 ranks x 16 experts, A = 16384 rows, H = 7168, int8
SEED = Preset("seed", 16384, 7168, 256, 1, "SPEC 1.1's rerouting call, 1 case: 1.6 GB peak, ~20 s")

PRESETS: dict[str, Preset] = {
    "tiny": Preset("tiny", 64, 32, 8, 2, "a smoke test, 24 cases: 0.5 GB peak, ~10 s"),
    "seed": SEED,
    "mixtral": Preset(
        "mixtral", 4096, 4096, 8, 2, "Mixtral 8x7B, T = 4096, 24 cases: 5.0 GB peak (3.6 GB with --no-stock), ~2 min"
    ),
    "qwen3-235b": Preset("qwen3-235b", 4096, 4096, 128, 8, "Qwen3-235B, T = 4096, 24 cases (opt-in): over 7.5 GB peak"),
    "deepseek-v3": Preset(
        "deepseek-v3", 4096, 7168, 256, 8, "DeepSeek-V3, T = 4096, 24 cases (opt-in): over qwen3-235b (not measured)"
    ),
}
#: what ``moe-onnx bench`` runs without ``--shape``: the presets that fit in a few GB
DEFAULT_PRESETS = ("seed", "mixtral")
#: run only when asked for (``--shape NAME`` or ``--shape all``)
HEAVY_PRESETS = ("qwen3-235b", "deepseek-v3")
#: every preset but tiny
ALL_PRESETS = ("seed", "deepseek-v3", "qwen3-235b", "mixtral")
SHAPES = (*PRESETS, "all")


@dataclass(frozen=True)
class LayerShape:
    name: str
    hidden: int  # H
    inter: int  # I, one expert's width
    experts: int  # E
    top_k: int  # K
    about: str

    def weight_bytes_per_expert(self, itemsize: int = 4) -> int:
        return 3 * self.hidden * self.inter * itemsize


#: layer shapes (the sizes issue 31 measured), small enough that a run fits a shared 2-core machine
LAYER_SHAPES: dict[str, LayerShape] = {
    "mixtral": LayerShape("mixtral", 1024, 1024, 8, 2, "Mixtral-like: H 1024, I 1024, E 8, K 2 (100 MB of weights)"),
    "qwen3": LayerShape("qwen3", 1024, 256, 64, 8, "Qwen3-like: H 1024, I 256, E 64, K 8 (200 MB)"),
    "deepseek": LayerShape("deepseek", 2048, 768, 64, 8, "DeepSeek-like: H 2048, I 768, E 64, K 8 (1.2 GB)"),
    "tiny": LayerShape("tiny", 32, 16, 8, 2, "a smoke test: H 32, I 16, E 8, K 2"),
}
DEFAULT_LAYERS = ("mixtral", "qwen3", "deepseek")
#: ``moe-onnx bench --layer`` choices
LAYERS = (*LAYER_SHAPES, "all")

PRESET_HELP = (
    "presets (--shape; default: seed and mixtral, 5.0 GB peak, ~2.5 min):\n"
    + "\n".join(f"  {p.name:12} {p.about}" for p in PRESETS.values())
    + "\n  all          every preset but tiny (the peak of deepseek-v3)\n"
    "MOE_ONNX_MAX_BYTES (e.g. 6G) skips each case whose estimated peak is above it.\n"
    "--no-stock skips the stock output path, the slowest and the one that needs the most memory\n"
    "(outputs as Python lists, ~40 bytes an element; cases over 40M output elements skip it anyway).\n"
    "Ctrl-C or SIGTERM writes the rows finished so far (--json, --markdown, --plot), then exits 130 / 143."
)
