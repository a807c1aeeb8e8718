"""`fuse` over a representative subset of the experts-interface families (tests/fuse_families.py
runs them all: ``python -m tests.fuse_families``; its table is in docs/transformers.md): one
family per router and block kind that the sweep found, both forms, each fused model against
the original export at sequence lengths 1, 7, 33 (within 1e-5 relative), no expert weight read
outside GroupedMatmul; a block or router fuse cannot prove is asserted by its reason.
"""

from __future__ import annotations

import pytest

from .fuse_families import FORMS, run

#: family -> (the router line every fused block's report starts with, the first reason of every
#: skipped block or None where every block fuses)
EXPECTED = {
    # sigmoid + bias, no groups: MoeGatingTopK with group_count 1
    "afmoe": ("MoeGatingTopK (sigmoid, bias, scale 1) (4 synthetic batches", None),
    # grouped sigmoid as DeepSeek-V3, routed scaling 1
    "glm4_moe": ("MoeGatingTopK (sigmoid, bias, 2 groups keep 1, scale 1) (4 synthetic batches", None),
    # top-k of the logits, then softmax of those (as gpt-oss)
    "cohere2_moe": ("MoeGatingTopKSoftmax + renormalisation (top-k logits, then softmax) (4 synthetic batches", None),
    # sigmoid top-k whose weights are not the gathered sigmoid scores: stays, with the reason
    "flint": ("left as exported: the routing weights are not the chosen experts' sigmoid scores", None),
    # softmax, a bias on the selection only, renormalised: MoeGatingTopK norm_type 0, renorm 1
    "ernie4_5_moe": ("MoeGatingTopK (softmax, renormalised, bias, scale 1) (4 synthetic batches", None),
    # the top k of logits + bias, weighted by the sigmoid of the chosen logits: no gating op, stays
    "kolibri1": ("left as exported: the TopK reads neither a softmax over the experts", None),
    # top-1 whose skip expert's id is masked after the TopK: the rows' own [T, 1] index (batched_mm)
    # or the flat [T] ids (grouped_mm) are the ids; the router stays
    "zaya": ("left as exported: the expert ids are not a TopK's indices", None),
    # a per-expert RMSNorm between the experts and the weighting (K = 1 on repeated rows): no reading proven
    "ergo": ("", "no reading of the block computes what it does: SwiGlu on rows"),
}


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_each_family_fuses_or_says_why(family, form, tmp_path):
    router, reason = EXPECTED[family]
    row = run(family, form, tmp_path)
    assert not row.error, row.error
    assert row.layers and len(row.blocks) == row.layers, row
    if reason is None:
        assert row.fused and not row.outside, row
        assert all(r.startswith(router) for r in row.routers), row.routers
    else:
        assert row.blocks == ["skipped"] * row.layers and all(r.startswith(reason) for r in row.reasons), row
    assert row.difference is not None and row.difference <= 1e-5, row
