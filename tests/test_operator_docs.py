"""The operator reference (docs/operators/, written by docs/generate.py from the OpDefs): up to
date, every op's example runs as written and prints what its page shows, a new op needs only a
rerun, and no page cites a contract the repository does not hold."""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import io
import os
import re

import numpy as np
import onnx
import pytest

import moe_onnx
import moe_onnx.custom_ops as custom_ops
from moe_onnx.custom_ops import KERNEL_FUNCTIONS, OPS, MoeOpError, schemas
from moe_onnx.custom_ops.opdef import Example, Input, OpDef, Output

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = os.path.join(ROOT, "docs", "operators")


def load_generator():
    spec = importlib.util.spec_from_file_location("docs_generate", os.path.join(ROOT, "docs", "generate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generate():
    return load_generator()


def page_blocks(name: str) -> tuple[str, str]:
    """The example program of an op's page and the text it says the program prints."""
    with open(os.path.join(PAGES, f"{name}.md"), encoding="utf-8") as f:
        text = f.read()
    match = re.search(r"## Example\n\n```python\n(.*?)```\n\nprints\n\n```text\n(.*?)```", text, re.S)
    assert match, f"docs/operators/{name}.md has no example"
    return match[1], match[2]


def test_the_pages_are_up_to_date(generate):
    assert generate.stale() == [], "rerun: python docs/generate.py"


def test_every_op_has_a_page_with_an_example():
    assert sorted(f[:-3] for f in os.listdir(PAGES) if f != "README.md") == sorted(OPS)
    assert [name for name, op in OPS.items() if op.example is None] == []


@pytest.mark.parametrize("name", sorted(OPS))
def test_each_example_runs_as_written_and_prints_what_its_page_shows(name, tmp_path, monkeypatch):
    program, shown = page_blocks(name)
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(program, f"docs/operators/{name}.md", "exec"), {"__name__": "__main__"})
    assert printed.getvalue() == shown


def test_a_page_states_the_declaration(generate):
    page = generate.op_page(OPS["MoeReRoutingV2"], generate.spec_sections(), {})
    assert "| `idx_type` | int | `0` | `0`, `1` | 0 = gather index, 1 = scatter index |" in page
    assert "| 2 | `per_token_scales` | float32, float8e8m0, uint8 | 1 or 2 or 3 | optional:" in page
    assert "- per_token_scales dim 0 must equal A = tokens dim 0" in page  # read from _infer
    assert "[SPEC 1.1](../spec/SPEC.md#spec-1.1)" in page
    assert "- the NPU implements this op on ascend950 only" in page


def test_a_new_op_needs_only_a_rerun(generate, monkeypatch):
    """An op the generator has never seen gets its page, example output included."""

    def double(x):
        return (x * 2,)

    def infer(sig):
        sig.require(sig.input("x").rank in (None, 1), "x must be a vector")
        sig.output("y", sig.input("x").dtype, sig.input("x").shape)

    op = OpDef(
        "DoubleIt",
        "DoubleIt: twice each element.",
        [Input("x", ("float32",), "[N] values")],
        [Output("y", ("float32",), "[N] twice x")],
        [],
        infer,
        double,
        example=Example(inputs={"x": np.array([1.0, 2.5], np.float32)}),
    )
    # what "one file, one list entry" gives a new op: its OpDef listed, its schema registered
    monkeypatch.setitem(custom_ops.OPS, "DoubleIt", op)
    monkeypatch.setitem(custom_ops.ALL_OPS, (op.domain, "DoubleIt"), op)
    monkeypatch.setitem(custom_ops.KERNEL_FUNCTIONS, "DoubleIt", "double_it")
    monkeypatch.setattr(custom_ops, "double_it", lambda *a, **k: op(*a, **k), raising=False)
    schemas.register([op])
    try:
        page = generate.op_page(op, generate.spec_sections(), {})
        index = generate.index_page(generate.spec_sections())
    finally:
        onnx.defs.deregister_schema("DoubleIt", moe_onnx.OPSET_VERSION, op.domain)
    assert "- x must be a vector" in page and "| 0 | `x` | float32 | any | [N] values |" in page
    assert "from moe_onnx.custom_ops import double_it" in page
    assert "y [2.0, 5.0]" in page  # the example ran, through the kernel and a session
    assert "[DoubleIt](DoubleIt.md) | twice each element |" in index


def test_check_mode_names_a_stale_page(generate, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(generate, "OUT", str(tmp_path))
    for file, text in generate.pages().items():
        (tmp_path / file).write_text(text)
    assert generate.main(["--check"]) == 0
    (tmp_path / "SwiGlu.md").write_text("edited by hand\n")
    (tmp_path / "Gone.md").write_text("an op that no longer exists\n")
    assert generate.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "docs/operators/SwiGlu.md is out of date" in err and "docs/operators/Gone.md" in err


CITATION = re.compile(r"\b(?:SPEC(?:-layer|-mc2)? \d+\.\d+|SPEC section \d|seeds? \d{3})")


@pytest.mark.parametrize(
    "path",
    [
        "README.md",
        *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)),
    ],
)
def test_every_citation_of_the_contract_links_into_the_repository(path):
    """ "SPEC 1.x" or "seed 00N" outside code is a link into docs/spec/ (the file a reader has)."""
    if path.startswith(os.path.join("docs", "spec")):
        return  # the contract itself
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = re.sub(r"```.*?```|`[^`\n]*`", "", f.read(), flags=re.S)
    text = re.sub(r"\[[^\]]*\]\((?:\.\./)*(?:docs/)?spec/[^)]*\)", "", text)  # the links themselves
    assert CITATION.findall(text) == []
    for target in re.findall(r"\]\(((?:\.\./)*(?:docs/)?spec/[^)#]*)", open(os.path.join(ROOT, path)).read()):
        assert os.path.exists(os.path.join(os.path.dirname(os.path.join(ROOT, path)), target)), target


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_op_has_its_kernel_function(name):
    """``moe_onnx.custom_ops.<snake_case>`` is a function (not the module of that name), runs the
    op's checks and gives what the op gives."""
    function = getattr(custom_ops, KERNEL_FUNCTIONS[name])
    assert callable(function) and function.__name__ == KERNEL_FUNCTIONS[name]
    example = OPS[name].example
    if example.ranks:
        assert "communicator" in OPS[name].needs
        return
    inputs = [example.inputs.get(n) for n in OPS[name].input_names]
    got = function(*inputs, **example.attrs)
    want = OPS[name](*inputs, **example.attrs)
    assert all((a is None and b is None) or np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    with pytest.raises(MoeOpError, match=rf"^{name}\b.*unknown attribute"):
        function(*inputs, no_such_attribute=1, **example.attrs)


def test_the_readme_pattern_carries_over_to_every_op():
    from moe_onnx.custom_ops import moe_gating_top_k_softmax  # the TypeError: a module
    from moe_onnx.custom_ops.moe_gating_top_k_softmax import MOE_GATING_TOP_K_SOFTMAX  # modules still load

    y, expert_idx, _ = moe_gating_top_k_softmax(np.array([[0.0, 1.0, 3.0]], np.float32), k=2)
    assert expert_idx.tolist() == [[2, 1]] and MOE_GATING_TOP_K_SOFTMAX.name == "MoeGatingTopKSoftmax"
    assert moe_onnx.custom_ops.__all__.count("moe_gating_top_k_softmax") == 1
