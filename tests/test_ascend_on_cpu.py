"""docs/ascend-on-cpu.md lists every Ascend name we serve, and its example and the README's
"Running Ascend code on a CPU" example run as printed."""

from __future__ import annotations

import os
import re
import sys

import moe_onnx.torch as mt
from moe_onnx.torch import graph_mode, ops_transformer
from moe_onnx.torch.stand_ins import STAND_INS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "ascend-on-cpu.md")


def _text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_every_served_name_has_a_row_in_the_page():
    """A torch_npu name added to any family (or a seeds' API name) must be listed, with the op it
    runs and its SPEC section."""
    rows = {m[1] for m in re.finditer(r"^\| `([A-Za-z_0-9]+)` \|", _text(PAGE), re.MULTILINE)}
    missing = sorted(set(mt.npu.NAMES) - rows) + sorted(set(ops_transformer.NAMES) - rows)
    assert not missing, f"add a row to docs/ascend-on-cpu.md for {missing}"
    assert all(f"torchair.{name}(" in _text(PAGE) for name in graph_mode.NAMES)


def _python_block(text: str, after: str) -> str:
    """The first ```python block after the line ``after``."""
    start = text.index(after)
    match = re.search(r"```python\n(.*?)```", text[start:], re.DOTALL)
    assert match, f"no python block after {after!r}"
    return match[1]


def test_the_page_and_readme_examples_run():
    """As printed; the stand-ins they install leave sys.modules afterwards."""
    readme = _python_block(_text(os.path.join(ROOT, "README.md")), "## Running Ascend code on a CPU")
    page = _python_block(_text(PAGE), "# Running Ascend code on a CPU")
    try:
        for name, code in (("README.md", readme), ("docs/ascend-on-cpu.md", page)):
            namespace: dict = {"__name__": "example"}
            exec(compile(code, name, "exec"), namespace)  # noqa: S102 - the documented example
            assert namespace["expanded_x"].shape == (8, 8) and namespace["rows"].shape == (8, 8)
    finally:
        for name in STAND_INS:
            sys.modules.pop(name, None)
