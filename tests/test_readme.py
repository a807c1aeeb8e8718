"""Every block of the README runs as written.

Which test runs which block (checked by ``test_every_block_is_run``):

* the first block's two commands: installing is what the fresh-venv check before each merge
  does (a clean clone, ``python3 -m venv``, both commands); ``moe-onnx demo`` is
  ``tests/test_ranks.py::test_demo_command``; ``pytest`` is this suite;
* "Quick start": every command in a fresh folder, as a shell runs it, then the Python block
  that compares the runs (``-m slow``: MPI and the bench take ~40 s);
* "Using it from Python": here;
* "Exporting from PyTorch": ``tests/test_torch_export.py::test_readme_example_runs``;
* "Running Ascend code on a CPU": ``tests/test_ascend_on_cpu.py::test_the_page_and_readme_examples_run``;
* "From transformers to cann.moe": ``tests/test_transformers_docs.py``.

The blocks of ``docs/*.md`` follow one convention (``test_every_block_of_the_docs_runs_or_says_why_not``):
run here, or marked ``<!-- synopsis: why -->`` / ``<!-- run by tests/<file>.py -->`` on the line
before; the operator pages (``docs/operators/``) are run by ``tests/test_operator_docs.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = (Path(__file__).parents[1] / "README.md").read_text()
FIRST_BLOCK = (
    "pip install -e . && moe-onnx demo                   # the main job on a built-in example\n"
    "pip install -e '.[test]' && python3 -m pytest -q    # the tests\n"
)


def blocks(text: str) -> list[tuple[str, str, str]]:
    """(section heading, language, code) of every fenced block, in order."""
    found = []
    section = ""
    for match in re.finditer(r"(?m)^(## [^\n]*)$|^```(\w*)\n(.*?)^```", text, re.S):
        if match[1]:
            section = match[1][3:]
        else:
            found.append((section, match[2], match[3]))
    return found


def section_blocks(heading: str) -> list[tuple[str, str]]:
    return [(language, code) for section, language, code in blocks(README) if section == heading]


def test_every_block_is_run():
    sections = [(section, language) for section, language, _ in blocks(README)]
    assert sections == [
        ("", "bash"),  # the first block
        ("Quick start", "bash"),
        ("Quick start", "python"),
        ("Using it from Python", "python"),
        ("Exporting from PyTorch", "python"),
        ("Running Ascend code on a CPU", "python"),
        ("From transformers to cann.moe", "python"),  # tests/test_transformers_docs.py
    ], "a block was added or moved: run it in a test and list it here"
    assert blocks(README)[0][2] == FIRST_BLOCK  # the two commands that work on a fresh machine
    torch_test = (Path(__file__).parent / "test_torch_export.py").read_text()
    assert 'readme.index("## Exporting from PyTorch")' in torch_test
    ascend_test = (Path(__file__).parent / "test_ascend_on_cpu.py").read_text()
    assert '"README.md")), "## Running Ascend code on a CPU")' in ascend_test


def test_using_it_from_python(tmp_path, monkeypatch, capsys):
    ((language, code),) = section_blocks("Using it from Python")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    assert "must equal A = tokens.shape[0] = 6, got 10 [CANN 561002]" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.mpi
def test_quick_start(tmp_path, monkeypatch):
    """As a newcomer types it: each line in a shell, in an empty folder, then the check."""
    (_, commands), (_, check) = section_blocks("Quick start")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    for line in commands.splitlines():
        line = re.sub(r"^python ", f"{sys.executable} ", line)
        result = subprocess.run(line, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{line}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    assert sorted(os.listdir(tmp_path / "converted")) == [f"rank{r}.onnx" for r in range(4)]
    monkeypatch.chdir(tmp_path)
    exec(compile(check, "README.md", "exec"), {})


DOCS = Path(__file__).parents[1] / "docs"
#: the languages of code (a block in another one, or none, is a display: a tree, a table of text)
CODE = ("python", "bash", "sh", "shell", "console")
#: the line before a block that says how it is covered
MARK = re.compile(r"<!-- (synopsis|run by (tests/\S+\.py))\b[^>]*-->\n$")


def doc_blocks(page: Path) -> list[tuple[str, str, re.Match | None]]:
    """(language, code, the mark before it or None) of every fenced code block of ``page``."""
    text = page.read_text()
    found = []
    for match in re.finditer(r"(?m)^```(\w*)\n(.*?)^```", text, re.S):
        if match[1] in CODE:
            found.append((match[1], match[2], MARK.search(text[: match.start()][-300:])))
    return found


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_every_block_of_the_docs_runs_or_says_why_not(page, tmp_path, monkeypatch):
    """The convention: a code block of docs/*.md is run here as written (python), or the line
    before it says ``<!-- synopsis: why -->`` (a command's form, a long run) or
    ``<!-- run by tests/<file>.py -->`` (a test that runs it, and names this page)."""
    monkeypatch.chdir(tmp_path)
    for language, code, mark in doc_blocks(DOCS / page):
        if mark is None:
            assert language == "python", f"{page}: a {language} block is run by no test: run it, or mark it synopsis"
            exec(compile(code, f"docs/{page}", "exec"), {"__name__": "__main__"})
        elif mark[2] is not None:
            test = Path(__file__).parents[1] / mark[2]
            assert page in test.read_text(), f"{test.name} does not run docs/{page}"
