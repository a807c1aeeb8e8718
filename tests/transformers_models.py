"""Tiny random transformers-5 MoE models, built from their config classes (nothing is downloaded).

:data:`FAST` are the families CI runs on every push; :func:`interface_families` lists every
causal-LM family of the installed transformers whose modeling file uses the experts
interface, and :func:`tiny_config` shrinks any of their configs with one set of overrides
(only the keys a config has), plus the few per-family fixes in :data:`FIXES`.
"""

from __future__ import annotations

import importlib
import inspect

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB = 64
EXPERTS = 8
TOP_K = 2

#: one size for every family; a key is applied only where the config has it
SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "expert_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,  # = heads: the latent-attention families (DeepSeek-V2/V3 kin) require it
    "head_dim": 8,
    "max_position_embeddings": 256,
    "num_local_experts": EXPERTS,
    "num_experts": EXPERTS,
    "n_routed_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 16,
    "v_head_dim": 8,
    "sliding_window": 16,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

#: per-family corrections on top of SMALL (model_type -> overrides)
FIXES: dict[str, dict] = {
    "mixtral": {"num_key_value_heads": 2},  # grouped-query attention on the fast path
    "qwen3_moe": {"norm_topk_prob": True},  # as Qwen3-30B-A3B ships
    "dots1": {"n_shared_experts": 1, "norm_topk_prob": True},  # the shared expert's width is n * moe_intermediate
    "qwen4_exp": {  # the indexed-attention layer needs its QSA indexer; a small hyper-connection mixer
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 8,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
        "hc_lowrank": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
    },
    "dots3_note": {  # the sliding layers' own attention sizes (swa_*), the indexer, the towers' adapter widths
        "head_dim": 16,
        "shared_experts_intermediate_size": 16,
        "index_topk": 64,  # >= every tested length: min(index_topk, S) is S, in eager and in the export alike
        "index_head_dim": 16,
        "index_n_heads": 2,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 4,
        "swa_q_lora_rank": 16,
        "swa_kv_lora_rank": 16,
        "swa_head_dim": 16,
        "swa_qk_nope_head_dim": 8,
        "swa_v_head_dim": 8,
        "towers": {"vision_config": {"adapter_out_dim": 32}, "audio_config": {"adapter_out_dim": 32}},
    },
    "bailing_hybrid": {"num_expert_group": 2, "num_experts_per_token": TOP_K},  # SMALL's names are aliases here
    "granitemoehybrid": {  # Mamba heads that divide 2 * hidden; a Mamba layer and an attention layer
        "mamba_n_heads": 4,
        "mamba_d_state": 8,
        "mamba_chunk_size": 16,
        "shared_intermediate_size": 16,
        "layer_types": ["linear_attention", "full_attention"],
    },
    "hy_v4": {  # a shared-indexer layer reads the full indexer layer before it; a small indexer
        "indexer_types": ["full", "shared"],
        "index_topk": 64,  # >= every tested length: min(index_topk, S) is S, in eager and in the export alike
        "index_head_dim": 16,
        "index_n_heads": 2,
    },
    "kolibri1_1": {  # a sliding layer, then an indexed one indexing itself; head_dim a multiple of 16 (NVFP4)
        "layer_types": ["sliding_attention", "indexed_attention"],
        "index_layers": [1],
        "kv_source_layers": [0, 1],
        "head_dim": 16,
        "num_key_value_heads": 2,
        "index_num_heads": 2,
        "index_topk": 8,
        "index_pool_size": 16,
        "index_compression": 4,
        "index_num_local_tokens": 4,
        "index_num_sink_tokens": 2,
        "mlp_only_intermediate_size": 16,
    },
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},  # no default layout
    "mimo_v2_flash": {"num_key_value_heads": 2},  # sliding layers double the key/value heads (to 4 = heads)
    "zaya": {"num_experts_per_tok": 1, "router_hidden_size": 16},  # top-1 only (its config validates it)
    "gemma4": {  # the MoE block is opt-in; text only (no vision / audio towers)
        "enable_moe_block": True,
        "top_k_experts": TOP_K,
        "global_head_dim": 8,
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": VOCAB,
        "towers": {"vision_config": None, "audio_config": None},
    },
}

#: the families CI runs (the fast path); the rest run under `slow`
FAST = ("mixtral", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")
#: the other interface families of the installed transformers (checked under `slow`)
SLOW = (
    "afmoe", "axk1", "axk2", "bailing_hybrid", "beam", "cohere2_moe", "deepseek_v2", "deepseek_v32", "deepseek_v4",
    "dots1", "dots3_note", "ergo", "ernie4_5_moe", "exaone_moe", "flex_olmo", "flint", "gemma4", "glm4_moe",
    "glm4_moe_lite", "glm_moe_dsa", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared",
    "hunyuan_v1_moe", "hy_v3", "hy_v4", "jamba", "kimi_linear", "kolibri1", "kolibri1_1", "laguna", "lara_mini",
    "lfm2_moe", "longcat_flash", "mellum", "mimo_v2_flash", "minicpm5_moe", "minimax", "minimax_m2", "nemotron_h",
    "phimoe", "qwen2_moe", "qwen3_5_moe", "qwen3_next", "qwen4_exp", "solar_open", "zaya",
)  # fmt: skip


def _shrunk(config_class, fixes: dict, extra: dict):
    """``config_class`` with SMALL's keys its defaults have, its per-layer lists cut to the last
    layers, then ``fixes``, then ``extra``."""
    defaults = config_class().to_dict()
    kwargs = {k: v for k, v in SMALL.items() if k in defaults}
    layers = fixes.get("num_hidden_layers", SMALL["num_hidden_layers"])
    default_layers = defaults.get("num_hidden_layers")
    for key, value in defaults.items():  # per-layer lists (attention kinds, dense/sparse MLPs): the last layers
        if isinstance(value, list) and default_layers and len(value) == default_layers and key not in kwargs:
            kwargs[key] = value[-layers:]
    kwargs.update(fixes)
    kwargs.update(extra)
    return config_class(**kwargs)


def tiny_config(model_type: str, **extra):
    """A tiny config of ``model_type``: SMALL's keys the default config has, then FIXES, then ``extra``.

    A multimodal family's config shrinks its ``text_config`` (FIXES' keys and ``extra`` go
    there) and drops its optional vision/audio towers (FIXES' ``"towers"`` says what replaces
    them); where AutoModelForCausalLM builds the text model's causal LM, that is all it reads.
    """
    config_class = CONFIG_MAPPING[model_type]
    fixes = dict(FIXES.get(model_type, {}))
    text_class = getattr(config_class, "sub_configs", {}).get("text_config")
    if text_class is None:
        return _shrunk(config_class, fixes, extra)
    towers = fixes.pop("towers", {})
    return config_class(text_config=_shrunk(text_class, fixes, extra), **towers)


def tiny_model(model_type: str, dtype=torch.float32, seed: int = 0, **extra):
    """``AutoModelForCausalLM.from_config(tiny_config(...))`` in eval mode, weights scaled up
    from transformers' small init so that the experts' outputs matter in the logits."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type, **extra)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "experts" in name or name.endswith(("gate.weight", "router.weight")):
                parameter.normal_(0, 0.5 / parameter.shape[-1] ** 0.5 if parameter.dim() > 1 else 0.1)
    return model.to(dtype)


def interface_families() -> list[str]:
    """Causal-LM model types whose modeling module uses ``@use_experts_implementation``."""
    found = []
    for model_type, class_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        module_name = f"transformers.models.{model_type}.modeling_{model_type}"
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if getattr(module, class_name, None) is None:
            continue
        if "@use_experts_implementation" in inspect.getsource(module):
            found.append(model_type)
    return found
