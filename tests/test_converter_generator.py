"""Equivalent spellings of one chunk sort convert to the same result (tests/chunk_sort_forms.py).

Each case draws a random spelling of the dispatch and restore of one layer (N, L, layout, probs,
movement noise, static or symbolic shapes) and checks, on thread ranks, bit for bit: the spelling
computes what the simplest spelling computes, and its conversion too (one MoeReRoutingV2, its
restore found). Derandomized: the default run takes a few seeds, ``-m slow`` many more.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import pytest

import moe_onnx
from moe_onnx.converters import insert_rerouting
from moe_onnx.ranks import run_threads
from tests.chunk_sort_forms import DISPATCH, RESTORE, SORTED_OUT, Form, build, feeds, random_form
from tests.support import assert_same_bits

FAST_SEEDS = range(6)
SLOW_SEEDS = range(6, 80)


def check_form(form: Form, seed: int) -> None:
    models = [build(form, r) for r in range(form.ranks)]
    simplest = [build(form.simplest(), r) for r in range(form.ranks)]
    inputs = feeds(form, seed)
    converted = []
    for model in models:
        onnx.checker.check_model(model, full_check=True)
        new, report = insert_rerouting(model)
        entries = [e for e in report.entries if e.status == "converted"]
        assert len(entries) == 1, f"{form.describe()}\n{report}"
        (entry,) = entries
        restores = 0 if form.sorted_out == "only" else 1  # a dispatch-only graph has none
        assert entry.rule == "movement_map" and len(entry.restores) == restores, f"{form.describe()}\n{report}"
        if form.probs:
            assert [e.status for e in report.entries].count("folded") == 1, f"{form.describe()}\n{report}"
        kinds = [(n.domain, n.op_type) for n in new.graph.node]
        assert kinds.count((moe_onnx.DOMAIN, "MoeReRoutingV2")) == 1
        converted.append(new)
    want = run_threads(simplest, inputs, timeout=60)
    got = run_threads(models, inputs, timeout=60)
    after = run_threads(converted, inputs, timeout=60)
    for wants, gots, afters in zip(want, got, after):
        assert len(wants) == len(gots) == len(afters)
        for w, g, a in zip(wants, gots, afters):  # the sorted rows as rows: spellings view them differently
            assert_same_bits(g.ravel(), w.ravel())  # the spelling is the layer
            assert_same_bits(a.ravel(), w.ravel())  # and so is its conversion


def test_every_spelling_is_drawn():
    """The random forms cover every dispatch and restore spelling (of both layouts)."""
    forms = [random_form(np.random.default_rng(seed)) for seed in range(200)]
    for layout in DISPATCH:
        assert {f.dispatch for f in forms if f.layout == layout} == set(DISPATCH[layout])
        assert {f.restore for f in forms if f.layout == layout} == set(RESTORE[layout])


def test_every_sorted_output_kind_is_drawn():
    forms = [random_form(np.random.default_rng(seed)) for seed in range(200)]
    for layout in DISPATCH:
        assert {f.sorted_out for f in forms if f.layout == layout} == set(SORTED_OUT)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("sorted_out", ["also", "only"])
def test_sorted_rows_as_graph_outputs_convert(sorted_out, seed):
    """Generated graphs whose expert-major rows (the chunk sort's result) are graph outputs, beside
    the experts or as the only outputs: converted, every output the same bits."""
    form = replace(random_form(np.random.default_rng(seed)), sorted_out=sorted_out)
    check_form(form, seed)


@pytest.mark.parametrize("seed", FAST_SEEDS)
def test_random_spelling_converts_to_the_same_result(seed):
    check_form(random_form(np.random.default_rng(seed)), seed)


@pytest.mark.parametrize(
    "form",
    [
        Form("dropless", 2, 2, dispatch, restore, experts_read, probs=True)
        for dispatch, restore, experts_read in (
            ("split_concat", "slices", "pieces"),
            ("gather", "scatter", "split"),
            ("slices", "split_concat", "split"),
        )
    ]
    + [
        Form("capacity", 3, 2, dispatch, "concat_axis1" if i % 2 else "transpose", symbolic=bool(i % 2), probs=True)
        for i, dispatch in enumerate(DISPATCH["capacity"])
    ],
    ids=lambda f: f"{f.layout}-{f.dispatch}-{f.restore}",
)
def test_each_spelling_once(form):
    check_form(form, 7)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SLOW_SEEDS)
def test_random_spelling_converts_to_the_same_result_slow(seed):
    check_form(random_form(np.random.default_rng(seed)), seed)
