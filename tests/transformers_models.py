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
}

#: the families CI runs (the fast path); the rest run under `slow`
FAST = ("mixtral", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")
#: the other interface families whose tiny model this module builds (checked under `slow`)
SLOW = (
    "afmoe", "cohere2_moe", "deepseek_v2", "deepseek_v32", "deepseek_v4", "ergo", "ernie4_5_moe", "exaone_moe",
    "flex_olmo", "flint", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "granitemoe", "granitemoe_swa",
    "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "jamba", "kimi_linear", "kolibri1", "laguna", "lara_mini",
    "longcat_flash", "mellum", "minicpm5_moe", "minimax", "minimax_m2", "nemotron_h", "phimoe", "qwen2_moe",
    "qwen3_next", "solar_open",
)  # fmt: skip
#: interface families whose tiny config SMALL + FIXES does not build yet (what fails), so untested
NOT_BUILT = {
    "axk1": "attention heads", "axk2": "attention heads", "bailing_hybrid": "linear-attention cache",
    "beam": "no sparse layer in 2 layers", "dots1": "a None size", "dots3_note": "too slow to build",
    "gemma4": "too slow to build", "granitemoehybrid": "layer layout validation", "hy_v4": "DSA layer layout",
    "kolibri1_1": "layer layout validation", "lfm2_moe": "layer layout", "mimo_v2_flash": "attention heads",
    "qwen3_5_moe": "too slow to build", "qwen4_exp": "a None size", "zaya": "layer layout validation",
}  # fmt: skip


def tiny_config(model_type: str, **extra):
    """A tiny config of ``model_type``: SMALL's keys the default config has, then FIXES, then ``extra``."""
    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class().to_dict()
    kwargs = {k: v for k, v in SMALL.items() if k in defaults}
    layers = defaults.get("num_hidden_layers")
    for key, value in defaults.items():  # per-layer lists (attention kinds, dense/sparse MLPs): the last layers
        if isinstance(value, list) and layers and len(value) == layers and key not in kwargs:
            kwargs[key] = value[-SMALL["num_hidden_layers"] :]
    kwargs.update(FIXES.get(model_type, {}))
    kwargs.update(extra)
    return config_class(**kwargs)


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
