"""moe_onnx.transformers: the "cann" experts implementation against transformers' own code.

The reference is transformers' "eager" experts implementation (its per-expert loop) on the
same tiny random model; nothing of moe_onnx computes it. Families in FAST run on every
push, the rest of the installed transformers' interface families under `slow`.
"""

from __future__ import annotations

import onnx
import onnxruntime as ort
import pytest
import torch

import moe_onnx
import moe_onnx.torch as mt
import moe_onnx.transformers as mtf

from .transformers_models import FAST, SLOW, VOCAB, interface_families, tiny_config, tiny_model

LENGTHS = ((1, 1), (1, 7), (2, 33))  # (batch, sequence)
CHAIN = ("MoeInitRoutingV3", "GroupedMatmul", "MoeFinalizeRoutingV2")
#: the router each fast family's tiny config has, as use_cann reports it
GATING = {
    "mixtral": "MoeGatingTopKSoftmax + renormalisation",
    "qwen3_moe": "MoeGatingTopKSoftmax + renormalisation",
    "olmoe": "MoeGatingTopKSoftmax",
    "deepseek_v3": "MoeGatingTopK (grouped sigmoid)",
    "gpt_oss": "MoeGatingTopKSoftmax + renormalisation",  # softmax of the top-k logits is the renormalised top-k
}


def token_ids(batch: int, sequence: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, sequence), generator=torch.Generator().manual_seed(seed + sequence))


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def relative(got, want) -> float:
    got, want = (torch.as_tensor(t).float() for t in (got, want))
    return float((got - want).abs().max() / want.abs().max())


def eager_and_cann(model_type: str, dtype=torch.float32, **extra):
    """The same tiny model twice: transformers' eager experts, and after use_cann."""
    reference = tiny_model(model_type, dtype, **extra)
    reference.set_experts_implementation("eager")
    model = tiny_model(model_type, dtype, **extra)
    reports = mtf.use_cann(model)
    return reference, model, reports


@pytest.fixture
def chain_calls(monkeypatch):
    """How often the experts called each cann.moe function (the forward reads them off mt)."""
    calls = {"moe_init_routing_v3": 0, "grouped_matmul": 0, "swi_glu": 0, "moe_finalize_routing_v2": 0}
    for name in calls:
        original = getattr(mt, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(mt, name, counted)
    return calls


def moe_layers(model) -> int:
    return sum(mtf.is_interface_experts(m) for m in model.modules())


@pytest.mark.parametrize("model_type", FAST)
def test_cann_experts_give_transformers_values(model_type, chain_calls):
    reference, model, reports = eager_and_cann(model_type)
    layers = moe_layers(model)
    assert layers >= 1 and len(reports) == layers
    assert {r.gating for r in reports} == {GATING[model_type]}, [r.line() for r in reports]
    for batch, sequence in LENGTHS:
        ids = token_ids(batch, sequence)
        assert relative(logits(model, ids), logits(reference, ids)) < 1e-5
    assert chain_calls["moe_init_routing_v3"] == chain_calls["moe_finalize_routing_v2"] == layers * len(LENGTHS)
    assert chain_calls["grouped_matmul"] == 2 * layers * len(LENGTHS)
    # gpt-oss's clamped gate is not silu(gate) * up: it stays torch between the two products
    assert chain_calls["swi_glu"] == (0 if model_type == "gpt_oss" else layers * len(LENGTHS))


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss"])
def test_cann_experts_train_like_transformers(model_type, chain_calls):
    """Autograd through the "cann" experts (MoeInitRoutingV3's backward is MoeInitRoutingV2Grad,
    then GroupedMatmul's, SwiGlu's and the combine's): the gradients of every parameter equal
    those of transformers' eager experts on the same model, routers left as transformers' own."""
    reference, model = tiny_model(model_type), tiny_model(model_type)
    reference.set_experts_implementation("eager")
    model.set_experts_implementation("cann")
    ids = token_ids(2, 9)
    for m in (reference, model):
        m.train()
        m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    grads = dict(model.named_parameters())
    checked = 0
    for name, want in reference.named_parameters():
        if want.grad is None:
            continue
        got = grads[name].grad
        assert got is not None, name
        assert relative(got, want.grad) < 1e-4, name
        checked += "experts" in name
    assert checked >= 2  # the experts' weights got gradients through the chain
    assert chain_calls["moe_init_routing_v3"] == chain_calls["moe_finalize_routing_v2"] == moe_layers(model) > 0


@pytest.mark.parametrize(
    ("model_type", "dtype"), [("mixtral", torch.bfloat16), ("gpt_oss", torch.bfloat16), ("qwen3_moe", torch.float16)]
)
def test_low_precision_follows_transformers(model_type, dtype):
    """bfloat16 / float16 weights in place; the ops round once where transformers rounds
    after each step, so the logits agree to the format's precision, not to the bit."""
    reference, model, _ = eager_and_cann(model_type, dtype)
    wide = tiny_model(model_type, torch.float32)
    wide.set_experts_implementation("eager")
    ids = token_ids(1, 9)
    got, want, exact = logits(model, ids), logits(reference, ids), logits(wide, ids)
    assert got.dtype == dtype
    # no further from float32 transformers than transformers' own low-precision run, give or take
    assert relative(got, exact) < 2 * relative(want, exact) + 1e-2


def exported(model, tmp_path, name="model.onnx"):
    path = tmp_path / name
    mtf.export_causal_lm(model, path)
    return path


def assert_experts_only_in_the_chain(proto: onnx.ModelProto, layers: int) -> None:
    """One chain per MoE layer; each GroupedMatmul reads an [E, ., .] initializer as it is
    stored, and no other node reads one (the experts are computed in the chain only). Other
    3-D initializers (a convolution's [C, 1, K] weight) are no experts'."""
    ops = [(n.domain, n.op_type) for n in proto.graph.node]
    for op in CHAIN:
        assert ops.count(("cann.moe", op)) == layers * (2 if op == "GroupedMatmul" else 1), op
    stored = {i.name: len(i.dims) for i in proto.graph.initializer}
    grouped = [n.input[1] for n in proto.graph.node if (n.domain, n.op_type) == ("cann.moe", "GroupedMatmul")]
    experts_weights = {name for name in grouped if stored.get(name) == 3}
    assert len(experts_weights) == 2 * layers, grouped
    for node in proto.graph.node:
        if experts_weights & set(node.input):
            assert (node.domain, node.op_type) == ("cann.moe", "GroupedMatmul"), node


def run_everywhere(model, path, layers: int, lowered_at=LENGTHS, lengths=LENGTHS) -> float:
    """InferenceSession (split executor) at every (batch, sequence), the lowered model in stock
    onnxruntime at ``lowered_at``, against transformers on the same model; the largest
    relative difference."""
    proto = onnx.load(path)
    assert_experts_only_in_the_chain(proto, layers)
    dims = [d.dim_param for d in proto.graph.input[0].type.tensor_type.shape.dim]
    assert all(dims), dims  # batch and sequence are symbolic
    session = moe_onnx.InferenceSession(path)
    lowered = ort.InferenceSession(
        moe_onnx.lower(proto, inline=True).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    largest = 0.0
    for batch, sequence in lengths:
        ids = token_ids(batch, sequence, seed=5)
        want = logits(model, ids)
        feeds = {"input_ids": ids.numpy()}
        runs = [session] + ([lowered] if (batch, sequence) in lowered_at else [])
        for run in runs:
            difference = relative(run.run(None, feeds)[0], want)
            print(f"  [{batch}, {sequence}] {'InferenceSession' if run is session else 'lowered'}: {difference:.1e}")
            assert difference < 1e-5, (batch, sequence, run)
            largest = max(largest, difference)
    return largest


@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_the_whole_causal_lm_exports_and_runs(model_type, tmp_path):
    reference, model, _ = eager_and_cann(model_type)
    path = exported(model, tmp_path)
    run_everywhere(reference, path, moe_layers(model))


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3_moe", "olmoe"])
def test_the_whole_causal_lm_exports_and_runs_slow(model_type, tmp_path):
    reference, model, _ = eager_and_cann(model_type)
    run_everywhere(reference, exported(model, tmp_path), moe_layers(model))


def test_one_block_alone_exports_with_dynamic_tokens(tmp_path):
    _, model, _ = eager_and_cann("qwen3_moe")
    block = model.model.layers[0].mlp
    x = torch.randn(1, 5, block.experts.gate_up_proj.shape[-1])
    path = tmp_path / "block.onnx"
    dims = {"hidden_states": {1: torch.export.Dim("tokens", min=1, max=4096)}}
    with torch.no_grad():
        mt.export(block, (x,), path, dynamic_shapes=dims)
    ops = [n.op_type for n in onnx.load(path).graph.node if n.domain == "cann.moe"]
    assert ops == [
        "MoeGatingTopKSoftmax",
        "MoeInitRoutingV3",
        "GroupedMatmul",
        "SwiGlu",
        "GroupedMatmul",
        "MoeFinalizeRoutingV2",
    ]
    session = moe_onnx.InferenceSession(path)
    # the dispatch and the four after it, back to back with no Cast between: one chain step
    from moe_onnx.runtime.chains import ExpertChainStep

    chains = [step for step in session._executor.steps if isinstance(step, ExpertChainStep)]
    assert len(chains) == 1 and chains[0].dispatch is not None
    for tokens in (1, 7, 33):
        x = torch.randn(1, tokens, x.shape[-1], generator=torch.Generator().manual_seed(tokens))
        with torch.no_grad():
            want = block(x)
        assert relative(session.run(None, {"hidden_states": x.numpy()})[0], want) < 1e-5


def test_a_router_no_gating_op_computes_stays_torch():
    """DeepSeek-V3's router without renormalisation: MoeGatingTopK always renormalises a
    sigmoid, so the probes reject it and the model still equals transformers."""
    reference, model, reports = eager_and_cann("deepseek_v3", norm_topk_prob=False)
    assert {r.gating for r in reports} == {"torch (no cann.moe gating op computes this router exactly)"}
    ids = token_ids(1, 7)
    assert relative(logits(model, ids), logits(reference, ids)) < 1e-5


def test_gating_can_be_left_alone():
    model = tiny_model("mixtral")
    reports = mtf.use_cann(model, gating=False)
    assert {r.gating for r in reports} == {"torch (gating not asked for)"}
    assert "MoeGatingTopKSoftmax" not in type(model.model.layers[0].mlp.gate).forward.__qualname__


def test_set_experts_implementation_alone_takes_cann():
    """Importing moe_onnx.transformers is enough for transformers' own switch."""
    reference = tiny_model("olmoe")
    reference.set_experts_implementation("eager")
    model = tiny_model("olmoe")
    model.set_experts_implementation("cann")
    assert model.config._experts_implementation == "cann"
    ids = token_ids(1, 7)
    assert relative(logits(model, ids), logits(reference, ids)) < 1e-5


def test_llama4_is_refused_by_name():
    import transformers

    config = transformers.Llama4TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=16,
        intermediate_size_mlp=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=1,
    )
    model = transformers.Llama4ForCausalLM(config).eval()
    with pytest.raises(mtf.ModelRefused, match=r"Llama4ForCausalLM \(llama4_text\): Llama4's experts"):
        mtf.use_cann(model)


def test_a_model_without_experts_is_refused():
    import transformers

    dense = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=16,
        )
    )
    with pytest.raises(mtf.ModelRefused, match=r"LlamaForCausalLM \(llama\) has no experts module"):
        mtf.use_cann(dense)


def test_expert_parallel_experts_are_refused():
    model = tiny_model("mixtral")
    mtf.use_cann(model)
    model.model.layers[0].mlp.experts._is_expert_parallel = True
    with pytest.raises(mtf.ExpertsRefused, match="MixtralExperts: .* expert parallelism"):
        logits(model, token_ids(1, 3))


@pytest.mark.slow
def test_torch_compile_gives_the_eager_values():
    _, model, _ = eager_and_cann("mixtral")
    block = model.model.layers[0].mlp
    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    for tokens in (3, 17):
        x = torch.randn(1, tokens, 32, generator=torch.Generator().manual_seed(tokens))
        with torch.no_grad():
            assert torch.equal(compiled(x), block(x))


@pytest.mark.slow
@pytest.mark.parametrize("model_type", SLOW)
def test_every_other_interface_family_gives_transformers_values(model_type):
    reference, model, reports = eager_and_cann(model_type)
    assert len(reports) == moe_layers(model) >= 1
    for batch, sequence in LENGTHS:
        ids = token_ids(batch, sequence)
        assert relative(logits(model, ids), logits(reference, ids)) < 1e-5, (batch, sequence)


@pytest.mark.slow
def test_the_family_lists_cover_the_pinned_transformers():
    """Every causal-LM family using the experts interface is tested (its tiny model builds)."""
    assert sorted(interface_families()) == sorted([*FAST, *SLOW])


#: the families export_causal_lm refuses (whole.UNEXPORTABLE), with the class holding the construct
REFUSED_WHOLE = {family: found.module_class for family, found in mtf.whole.UNEXPORTABLE.items()}
#: per-family config changes for the whole-LM export only (LongCat-Flash's 28 layers take ~8 min;
#: DeepSeek-V4's heavily compressed windows of 128 would be none at 33 tokens: 8 gives 0, 0, 4 windows
#: at 1, 7, 33, and an index_topk of 4 of the 8 CSA windows makes the indexer choose)
WHOLE_EXTRA = {
    "longcat_flash": {"num_layers": 1},
    "deepseek_v4": {
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "index_topk": 4,
    },
    # 8 QSA indexer heads: with 2, the ReLU sums tie at zero, where transformers' topk order is unspecified
    "qwen4_exp": {"indexer_n_heads": 8},
}
#: families whose export rewrite scans chunks of 64 tokens: also run at 150 (three chunks)
SCANNED_CHUNKS = {"qwen3_next", "qwen3_5_moe", "lara_mini", "qwen4_exp", "kimi_linear", "bailing_hybrid"}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [t for t in SLOW if t not in REFUSED_WHOLE])
def test_every_other_family_exports_whole(model_type, tmp_path):
    """One export (sequence length dynamic) per family, InferenceSession at 1, 7, 33 and the
    lowered model in stock onnxruntime at 7, against transformers' eager experts."""
    reference, model, _ = eager_and_cann(model_type, **WHOLE_EXTRA.get(model_type, {}))
    assert moe_layers(model) >= 1
    # a rewritten family runs lowered at every length too: its rewrite is what the export computes
    lowered_at = LENGTHS + ((1, 150),) if model_type in mtf.whole.EXPORT_PATCHES else ((1, 7),)
    originals = [(owner, name, owner.__dict__[name]) for owner, name in mtf.whole.patched_attributes(model_type)]
    lengths = (*LENGTHS, (1, 150)) if model_type in SCANNED_CHUNKS else LENGTHS
    largest = run_everywhere(
        reference, exported(model, tmp_path), moe_layers(model), lowered_at=lowered_at, lengths=lengths
    )
    for owner, name, original in originals:  # the rewrites held only while exporting
        assert owner.__dict__[name] is original, name
    print(f"{model_type}: largest relative difference {largest:.1e}")


def sparse_block(model) -> torch.nn.Module:
    """The module holding the first interface experts module (the family's sparse MoE block)."""
    for parent in model.modules():
        if any(mtf.is_interface_experts(child) for child in parent.children()):
            return parent
    raise AssertionError("no experts module")


def test_a_family_that_cannot_export_whole_is_refused_and_its_moe_block_exports(tmp_path, monkeypatch):
    """The refusal (no family of transformers 5.25.0 needs it since the export rewrites; OLMoE's
    attention stands in for a construct): ExportRefused before anything is written, naming the
    module and where the construct lives, and the MoE block alone still exports and runs."""
    construct = mtf.whole.Unexportable("OlmoeAttention", "modeling_olmoe:OlmoeAttention.forward", "stands in")
    monkeypatch.setitem(mtf.whole.UNEXPORTABLE, "olmoe", construct)
    _, model, _ = eager_and_cann("olmoe")
    with pytest.raises(mtf.ExportRefused, match=r"\(olmoe\): OlmoeAttention stands in \(modeling_olmoe:"):
        mtf.export_causal_lm(model, tmp_path / "model.onnx")
    assert not (tmp_path / "model.onnx").exists()
    block = sparse_block(model)
    hidden = model.config.get_text_config().hidden_size
    path = tmp_path / "block.onnx"
    with torch.no_grad():
        mt.export(block, (torch.randn(1, 5, hidden),), path, dynamic_shapes=({1: torch.export.Dim("tokens")},))
    assert {"MoeInitRoutingV3", "GroupedMatmul", "MoeFinalizeRoutingV2"} <= {
        n.op_type for n in onnx.load(path).graph.node if n.domain == "cann.moe"
    }
    session = moe_onnx.InferenceSession(path)
    for tokens in (1, 7, 33):
        x = torch.randn(1, tokens, hidden, generator=torch.Generator().manual_seed(tokens))
        with torch.no_grad():
            want = block(x)
        want = want[0] if isinstance(want, tuple) else want
        feeds = {session.get_inputs()[0].name: x.numpy()}
        assert relative(session.run(None, feeds)[0], want) < 1e-5, tokens


# ---- export-time rewrites (whole.EXPORT_PATCHES) against transformers' originals, eager ----


def visibility_masks(batch: int, queries: int, generator: torch.Generator):
    """[B, Q, K] visible-key masks: causal, causal with left padding in one row, a sliding window
    of 20, and a random 70% of the causal keys (masked keys between visible ones)."""
    causal = torch.ones(queries, queries, dtype=torch.bool).tril()
    padded = torch.ones(batch, queries, dtype=torch.bool)
    padded[0, :5] = False
    keys = torch.arange(queries)
    yield "causal", causal.expand(batch, queries, queries)
    yield "left padded", causal & padded[:, None, :]
    yield "sliding", (causal & (keys > keys[:, None] - 20)).expand(batch, queries, queries)
    yield "random", causal & (torch.rand(batch, queries, queries, generator=generator) < 0.7)


def test_the_kolibri1_1_indexer_rewrite_selects_transformers_keys():
    """select_pool / select_tokens over the whole [queries, keys] grid give transformers' masks,
    bit for bit, with long rows (more keys than the pool / the budget) among them."""
    from transformers.models.kolibri1_1 import modeling_kolibri1_1 as kolibri

    indexer = kolibri.Kolibri1_1Indexer(tiny_config("kolibri1_1"), 1)
    assert indexer.pool_size < 33 and indexer.is_pool_source
    narrowed = 0
    for queries in (1, 7, 33, 60):
        generator = torch.Generator().manual_seed(queries)
        q, k = torch.randn(2, 4, queries, 16, generator=generator), torch.randn(2, 2, queries, 16, generator=generator)
        for name, visible in visibility_masks(2, queries, generator):
            pool = indexer.select_pool(q, k, visible)
            assert torch.equal(mtf.patches.kolibri_select_pool(indexer, q, k, visible), pool), (queries, name)
            selected = indexer.select_tokens(q, k, visible, pool)
            assert torch.equal(mtf.patches.kolibri_select_tokens(indexer, q, k, visible, pool), selected), name
            narrowed += int((pool != visible).sum()) + int((selected != visible).sum())
    assert narrowed > 1000  # the selections did drop keys (not only the short-row identity)


def test_the_nvfp4_rewrite_rounds_as_the_float8_cast():
    """Every E4M3 value, every midpoint between two and their float32 neighbours, then
    nvfp4_fake_quantize on random values of 7 magnitudes: equal to transformers' float8 cast."""
    from transformers.models.kolibri1_1.modeling_kolibri1_1 import nvfp4_fake_quantize

    exact = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    exact = exact[torch.isfinite(exact) & (exact >= 2**-9) & (exact <= 448)].sort().values
    middles = (exact[1:] + exact[:-1]) / 2
    near = [torch.nextafter(x, torch.tensor(direction)) for x in (exact, middles) for direction in (0.0, 1e9)]
    values = torch.cat([exact, middles, *near]).clamp(2**-9, 448)
    assert torch.equal(mtf.patches.round_to_e4m3(values), values.to(torch.float8_e4m3fn).float())
    for magnitude in range(-3, 4):
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(magnitude + 3)) * 10.0**magnitude
        want, got = nvfp4_fake_quantize(x), mtf.patches.nvfp4_fake_quantize(x)
        assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit()), magnitude


@pytest.mark.parametrize("model_type", sorted(mtf.whole.EXPORT_PATCHES))
def test_export_patches_hold_only_inside_their_context(model_type):
    """Each family's rewrites are in place inside export_patches (found by the model's modules)
    and transformers' originals after; a model of another family gets none."""
    model = tiny_model(model_type)
    attributes = mtf.whole.patched_attributes(model_type)
    originals = [owner.__dict__[name] for owner, name in attributes]
    with mtf.whole.export_patches(model) as applied:
        assert applied == [mtf.whole.EXPORT_PATCHES[model_type].what]
        assert all(owner.__dict__[name] is not o for (owner, name), o in zip(attributes, originals))
    assert [owner.__dict__[name] for owner, name in attributes] == originals
    with mtf.whole.export_patches(tiny_model("olmoe")) as applied:
        assert applied == []


def test_the_deepseek_v4_compressor_rewrite_gives_transformers_logits():
    """The tiny DeepSeek-V4 with windows of 4 (CSA) and 8 (HCA) and 4 of the CSA windows indexed:
    at 1 .. 40 tokens (no window, one, two, more windows than index_topk) the rewritten compressors,
    indexer, attention and rotary give transformers' logits bit for bit, and the indexer picks
    the same entries."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Indexer

    model = tiny_model("deepseek_v4", **WHOLE_EXTRA["deepseek_v4"])
    indexer = next(m for m in model.modules() if isinstance(m, DeepseekV4Indexer))
    picks = []
    indexer.register_forward_hook(lambda module, args, output: picks.append(output))
    for sequence in (1, 3, 4, 8, 9, 17, 40):
        ids = token_ids(2, sequence)
        want = logits(model, ids)
        with mtf.whole.export_patches(model):
            got = logits(model, ids)
        assert torch.equal(got, want), sequence
        original, rewritten = picks[-2:]
        assert rewritten.shape[-1] == indexer.index_topk
        for row_original, row_rewritten in zip(original.flatten(0, 1), rewritten.flatten(0, 1)):
            chosen = set(row_rewritten.tolist()) - {-1}
            assert chosen == set(row_original.tolist()) - {-1}, sequence
            assert len(chosen) <= indexer.index_topk
    assert max(len(set(row.tolist()) - {-1}) for row in picks[-1].flatten(0, 1)) == indexer.index_topk


def test_the_qwen4_exp_indexer_rewrite_selects_transformers_keys():
    """_select_tokens over the whole [queries, keys] grid gives transformers' mask bit for bit for
    masks whose visible keys are one run per query (causal, left padded, sliding), with blocks
    chosen among more than block_topk (8 heads: with 2, ReLU sums tie at zero, where transformers'
    topk order is unspecified)."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextQSAIndexer

    model = tiny_model("qwen4_exp", **WHOLE_EXTRA["qwen4_exp"])
    indexer = next(m for m in model.modules() if isinstance(m, Qwen4ExpTextQSAIndexer))
    width = indexer.index_head_dim
    dropped = 0
    for queries in (1, 7, 33, 60):
        generator = torch.Generator().manual_seed(queries)
        hidden = torch.randn(2, queries, 32, generator=generator)
        q = torch.randn(2, queries, indexer.index_n_heads, width, generator=generator)
        keys, cos, sin = (torch.randn(2, queries, width, generator=generator) for _ in range(3))
        for name, visible in visibility_masks(2, queries, generator):
            if name == "random":  # not one run per query: not what the rewrite computes
                continue
            want = indexer._select_tokens(hidden, q, keys, cos, sin, visible[:, None])
            got = mtf.patches.qwen4_exp_select_tokens(indexer, hidden, q, keys, cos, sin, visible[:, None])
            assert torch.equal(got, want), (queries, name)
            dropped += int((want[:, 0] != visible).sum())
    assert dropped > 1000  # blocks were left out, not only every visible key kept


def test_the_jamba_scan_rewrite_gives_transformers_states():
    """torch's scan operator in place of the Python loop over the tokens: transformers' outputs and
    last state bit for bit, with and without the skip, gate and time-step bias, at 1 .. 33 tokens."""
    from transformers.models.jamba.modeling_jamba import mamba_selective_scan

    for tokens in (1, 2, 7, 33):
        generator = torch.Generator().manual_seed(tokens)
        x, dt, gate = (torch.randn(2, 8, tokens, generator=generator) for _ in range(3))
        decay = -torch.rand(8, 4, generator=generator)
        b, c = (torch.randn(2, 4, tokens, generator=generator) for _ in range(2))
        skip, bias = torch.randn(8, generator=generator), torch.randn(8, generator=generator)
        for options in ({}, {"D": skip, "z": gate, "delta_bias": bias, "delta_softplus": True}):
            want = mamba_selective_scan(x, dt, decay, b, c, return_last_state=True, **options)
            got = mtf.patches.jamba_selective_scan(x, dt, decay, b, c, return_last_state=True, **options)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), (tokens, sorted(options))


def test_the_gated_delta_rule_scan_gives_transformers_values():
    """torch's scan operator in place of the loop over chunks of 64: transformers' output and final
    state bit for bit, at one, two and three chunks, with grouped value heads and an initial state."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    for tokens in (1, 64, 65, 150):
        generator = torch.Generator().manual_seed(tokens)
        query, key = (torch.randn(2, tokens, 2, 8, generator=generator) for _ in range(2))
        value = torch.randn(2, tokens, 4, 8, generator=generator)
        decay = -torch.rand(2, tokens, 4, generator=generator)
        beta = torch.rand(2, tokens, 4, generator=generator)
        state = torch.randn(2, 4, 8, 8, generator=generator)
        for options in ({}, {"initial_state": state, "output_final_state": True, "use_qk_l2norm_in_kernel": True}):
            want = torch_chunk_gated_delta_rule(query, key, value, decay, beta, **options)
            got = mtf.patches.chunk_gated_delta_rule(query, key, value, decay, beta, **options)
            assert torch.equal(got[0], want[0]), (tokens, sorted(options))
            assert (got[1] is None and want[1] is None) or torch.equal(got[1], want[1])


def test_the_kimi_delta_attention_scan_gives_transformers_values():
    """Kimi delta attention with torch's scan operator in place of the loop over chunks of 64:
    transformers' output and final state bit for bit at one, two and three chunks."""
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    rewritten = mtf.patches.kimi_delta_attention(kimi.l2norm)
    for tokens in (1, 64, 65, 150):
        generator = torch.Generator().manual_seed(tokens)
        query, key, value = (torch.randn(2, tokens, 2, 8, generator=generator) for _ in range(3))
        decay = -torch.rand(2, tokens, 2, 8, generator=generator)
        beta = torch.rand(2, tokens, 2, generator=generator)
        state = torch.randn(2, 2, 8, 8, generator=generator)
        for options in ({}, {"initial_state": state, "output_final_state": True, "use_qk_l2norm_in_kernel": True}):
            want = kimi.chunk_kimi_delta_attention(query, key, value, decay, beta, **options)
            got = rewritten(query, key, value, decay, beta, **options)
            assert torch.equal(got[0], want[0]), (tokens, sorted(options))
            assert (got[1] is None and want[1] is None) or torch.equal(got[1], want[1])
