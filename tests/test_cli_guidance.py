"""A newcomer's second hour (issue 32): functions that take a model take a path too, convert and
lower treat OUT as a user means it and say what to do when there is nothing to do, and a
model's cann.moe opset import or a collective outside ranks is refused with the fix."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

import moe_onnx
from moe_onnx.converters import insert_rerouting
from moe_onnx.custom_ops import dtypes
from moe_onnx.custom_ops.errors import OpsetImportError
from tests.test_cli_commands import layer_folder, one_line, run_cli

FEEDS = {"x": np.arange(8, dtype=np.float32).reshape(2, 4)}


def plain_model(opset: int = 17) -> onnx.ModelProto:
    """A model with no cann.moe op (and an opset below what lowering needs)."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "plain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.fixture
def swi_glu_file(tmp_path) -> str:
    path = str(tmp_path / "swiglu.onnx")
    onnx.save(moe_onnx.single_node_model("SwiGlu", FEEDS), path)
    return path


# --- every public function that takes a model takes a path, a ModelProto or an onnx_ir.Model ----


def model_forms(path: str) -> list:
    return [path, pathlib.Path(path), onnx.load(path), ir.load(path)]


def test_lower_takes_every_form(swi_glu_file):
    for model in model_forms(swi_glu_file):
        lowered = moe_onnx.lower(model, inline=True)
        assert not any(n.domain == moe_onnx.DOMAIN for n in lowered.graph.node), type(model)


def test_sessions_and_prepare_take_every_form(swi_glu_file):
    want = moe_onnx.InferenceSession(swi_glu_file).run(None, FEEDS)[0]
    for model in model_forms(swi_glu_file):
        assert np.array_equal(moe_onnx.InferenceSession(model).run(None, FEEDS)[0], want)
        prepared = moe_onnx.prepare_for_ort(model)
        assert [n.domain for n in prepared.graph.node] != [moe_onnx.DOMAIN]


def test_insert_rerouting_takes_a_path(tmp_path):
    folder = layer_folder(tmp_path / "layer", ranks=2)
    path = os.path.join(folder, "rank0.onnx")
    converted, report = insert_rerouting(path)  # the AttributeError: 'str' has no 'clone'
    assert isinstance(converted, ir.Model) and report.changed
    assert "MoeReRoutingV2" in {n.op_type for n in converted.graph}
    proto, again = insert_rerouting(onnx.load(path))
    assert isinstance(proto, onnx.ModelProto) and str(again) == str(report)


@pytest.mark.parametrize("function", [moe_onnx.lower, insert_rerouting, moe_onnx.prepare_for_ort])
def test_something_else_is_refused_by_name(function, tmp_path):
    with pytest.raises(TypeError, match="an onnx.ModelProto, an onnx_ir.Model or a path"):
        function(42)
    with pytest.raises(FileNotFoundError, match="missing.onnx does not exist"):
        function(str(tmp_path / "missing.onnx"))


# --- convert / lower: OUT as a folder, a non-model OUT, nothing to do ----------------------------


@pytest.mark.parametrize("command", ["convert", "lower"])
@pytest.mark.parametrize("existing", [False, True])
def test_a_folder_as_out_means_out_slash_the_input_name(command, existing, tmp_path, capsys):
    source = layer_folder(tmp_path / "layer", ranks=2)
    out = tmp_path / "newdir"
    if existing:
        out.mkdir()
    target = str(out) + ("" if existing else "/")
    code, _, err = run_cli(capsys, command, os.path.join(source, "rank0.onnx"), target)
    assert code == 0, err
    assert os.listdir(out) == ["rank0.onnx"]  # no staging folder left, no temp name said
    assert ".moe_onnx_write_" not in err
    onnx.checker.check_model(str(out / "rank0.onnx"))


@pytest.mark.parametrize("command", ["convert", "lower"])
def test_an_existing_file_that_is_no_model_is_refused_before_work(command, tmp_path, capsys, swi_glu_file):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    code, out, err = run_cli(capsys, command, swi_glu_file, str(notes))
    assert code == 2 and out == ""  # before any work: no report
    assert "OUT" in one_line(err) and "exists and is not an ONNX model" in err
    assert notes.read_text() == "my notes"
    earlier = tmp_path / "earlier.onnx"  # an earlier output is replaced
    onnx.save(plain_model(), str(earlier))
    assert run_cli(capsys, command, swi_glu_file, str(earlier))[0] == 0


def test_a_write_that_fails_names_out_not_the_staging_folder(tmp_path, capsys, swi_glu_file, monkeypatch):
    from moe_onnx.commands import model_files

    def refuse(model, path, external_data=None):
        raise IsADirectoryError(21, "Is a directory", path)

    monkeypatch.setattr(model_files.ir, "save", refuse)
    code, _, err = run_cli(capsys, "lower", swi_glu_file, str(tmp_path / "out.onnx"))
    assert code == 2 and one_line(err).endswith(f"OUT {tmp_path / 'out.onnx'}: could not be written: Is a directory")
    assert ".moe_onnx_write_" not in err and os.listdir(tmp_path) == ["swiglu.onnx"]


def test_convert_without_an_all_to_all_says_what_convert_needs(tmp_path, capsys):
    source = tmp_path / "plain.onnx"
    onnx.save(plain_model(), str(source))
    code, out, err = run_cli(capsys, "convert", str(source), str(tmp_path / "out.onnx"))
    assert code == 0 and "at 0 all-to-all node(s)" in out
    note = one_line(err)
    assert note.startswith("note: no all-to-all node, so nothing to convert")
    assert "moe-onnx run IN" in note and "moe-onnx lower IN OUT" in note


@pytest.mark.parametrize("opset", [17, 18])
def test_lower_passes_a_model_without_cann_moe_ops_through(opset, tmp_path, capsys):
    source, target = tmp_path / "plain.onnx", tmp_path / "out.onnx"
    onnx.save(plain_model(opset), str(source))
    code, out, err = run_cli(capsys, "lower", str(source), str(target))
    assert code == 0 and err == ""
    assert out.strip() == f"wrote {target}: no cann.moe op to lower (collectives stay as they are): written unchanged"
    assert onnx.load(str(target)).graph == plain_model(opset).graph
    assert moe_onnx.lower(plain_model(opset)) == plain_model(opset)  # the function too (a copy)


# --- the cann.moe opset import, collectives without ranks -----------------------------------


def without_import() -> onnx.ModelProto:
    model = moe_onnx.single_node_model("SwiGlu", FEEDS)
    imports = [o for o in model.opset_import if o.domain != moe_onnx.DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(imports)
    return model


def with_version(version: int) -> onnx.ModelProto:
    model = moe_onnx.single_node_model("SwiGlu", FEEDS)
    next(o for o in model.opset_import if o.domain == moe_onnx.DOMAIN).version = version
    return model


@pytest.mark.parametrize("use", [moe_onnx.InferenceSession, moe_onnx.lower, moe_onnx.prepare_for_ort])
def test_a_missing_cann_moe_import_is_refused_with_the_fix(use):
    with pytest.raises(OpsetImportError, match=r"node 'node' \(cann.moe::SwiGlu\) is in domain cann.moe") as refused:
        use(without_import())
    assert 'model.opset_import.append(onnx.helper.make_opsetid("cann.moe", 1))' in str(refused.value)
    with pytest.raises(OpsetImportError, match="imports cann.moe version 7; this library implements version 1"):
        use(with_version(7))


def test_the_command_refuses_it_in_one_line(tmp_path, capsys):
    path = tmp_path / "no_import.onnx"
    onnx.save(without_import(), str(path))
    for command in (["run", str(path)], ["lower", str(path), str(tmp_path / "out.onnx")]):
        code, _, err = run_cli(capsys, *command)
        assert code == 2 and 'make_opsetid("cann.moe", 1)' in one_line(err), command


def test_a_collective_in_one_session_says_what_to_run():
    model = moe_onnx.single_node_model("AllGather", FEEDS)
    with pytest.raises(moe_onnx.MoeOpError) as refused:
        moe_onnx.InferenceSession(model).run(None, FEEDS)
    message = str(refused.value)
    assert "moe-onnx run MODEL --ranks N" in message and "moe_onnx.ranks.run_threads" in message
    assert "docs/running.md" in message and os.path.exists(
        os.path.join(os.path.dirname(__file__), "..", "docs", "running.md")
    )


# --- the example generator ----------------------------------------------------------------


def generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moe_onnx.models.ep_layer", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "args, why",
    [
        (["--top-k", "9", "--ranks", "2", "--local-experts", "3"], "--top-k 9 is more than the 6 experts"),
        (["--ranks", "0"], "argument --ranks: must be >= 1, got 0"),
        (["--hidden", "x"], "argument --hidden: must be a whole number >= 1, got 'x'"),
        (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    ],
)
def test_the_generator_checks_its_options_before_writing(args, why, tmp_path):
    done = generate(str(tmp_path / "layer"), *args)
    assert done.returncode == 2 and why in one_line(done.stderr), done.stderr
    assert not (tmp_path / "layer").exists()


def test_the_generator_refuses_a_file_as_out_and_explains_every_option(tmp_path):
    (tmp_path / "notes.txt").write_text("")
    done = generate(str(tmp_path / "notes.txt"))
    assert done.returncode == 2 and "OUT" in one_line(done.stderr) and "exists and is not a folder" in done.stderr
    from moe_onnx.models.ep_layer import parser

    actions = {a.dest: a.help for a in parser()._actions}
    assert {"out", "ranks", "local_experts", "top_k", "hidden", "ffn", "pattern", "seed"} <= set(actions)
    assert all(text and len(text.split()) > 2 for text in actions.values()), actions
    assert generate("--help").returncode == 0


# --- run --inputs / inputs: every element type the ops take ------------------------------------


def every_input_dtype() -> list[str]:
    return sorted({dtype for op in moe_onnx.OPS.values() for decl in op.inputs for dtype in decl.dtypes})


def model_taking(dtype: str) -> onnx.ModelProto:
    """A one-node model with a graph input of ``dtype``: AllGather takes almost any type;
    float8e8m0 is MoeReRoutingV2's [A, d, 2] scales."""
    if dtype in moe_onnx.OPS["AllGather"].inputs[0].dtypes:
        return moe_onnx.single_node_model("AllGather", {"x": np.zeros((3, 2), dtypes.numpy_dtype(dtype))})
    assert dtype == "float8e8m0", dtype
    counts = np.array([[1, 2]], np.int32)
    feeds = {
        "tokens": np.zeros((3, 2), np.float32),
        "expert_token_num_per_rank": counts,
        "per_token_scales": np.zeros((3, 1, 2), dtypes.numpy_dtype(dtype)),
    }
    model = moe_onnx.single_node_model("MoeReRoutingV2", feeds)
    kept = [i for i in model.graph.input if i.name != "expert_token_num_per_rank"]  # the counts a constant
    del model.graph.input[:]
    model.graph.input.extend(kept)
    model.graph.initializer.append(onnx.numpy_helper.from_array(counts, "expert_token_num_per_rank"))
    return model


def raw(path) -> dict[str, bytes]:
    with np.load(path) as data:
        return {name: data[name].tobytes() for name in data.files}


@pytest.mark.parametrize("dtype", every_input_dtype())
def test_inputs_writes_what_run_reads_back(dtype, tmp_path, capsys):
    path = str(tmp_path / "model.onnx")
    onnx.save(model_taking(dtype), path)
    assert run_cli(capsys, "inputs", path, str(tmp_path / "in"), "--ranks", "1")[0] == 0
    code, _, err = run_cli(capsys, "run", path, "--ranks", "1", "--outputs", str(tmp_path / "generated"))
    assert code == 0, err
    feeds = str(tmp_path / "in" / "rank{r}.npz")
    code, _, err = run_cli(capsys, "run", path, "--ranks", "1", "--inputs", feeds, "--outputs", str(tmp_path / "fed"))
    assert code == 0, err  # the issue: bfloat16 read back as raw bytes, refused by the session
    assert raw(tmp_path / "fed" / "rank0.npz") == raw(tmp_path / "generated" / "rank0.npz")


@pytest.mark.parametrize("dtype", ["bfloat16", "float8e4m3fn", "float8e5m2", "float8e8m0"])
def test_run_reads_arrays_numpy_saved_itself(dtype, tmp_path, capsys):
    """np.savez writes ml_dtypes arrays as bytes (bfloat16: 'V2'), float8e5m2 with a header
    numpy cannot read back ('<f1'): run views them as the graph input's type."""
    model = model_taking(dtype)
    path = str(tmp_path / "model.onnx")
    onnx.save(model, path)
    name = next(i.name for i in model.graph.input if i.type.tensor_type.elem_type == dtypes.onnx_type(dtype))
    values = np.arange(6).astype(dtypes.numpy_dtype(dtype))
    feeds = {
        i.name: np.zeros(
            [d.dim_value for d in i.type.tensor_type.shape.dim],
            dtypes.numpy_dtype(dtypes.name_of_onnx(i.type.tensor_type.elem_type)),
        )
        for i in model.graph.input
    }
    feeds[name] = values.reshape(feeds[name].shape)
    np.savez(tmp_path / "mine.npz", **feeds)
    code, _, err = run_cli(
        capsys, "run", path, "--ranks", "1", "--inputs", str(tmp_path / "mine.npz"), "--outputs", str(tmp_path / "o")
    )
    assert code == 0, err
    with np.load(tmp_path / "o" / "rank0.npz") as out:
        got = out[out.files[0] if dtype != "float8e8m0" else "permute_per_token_scales"]
    assert got.tobytes() == values.tobytes()  # one rank: gathered / rerouted rows are the rows fed


# --- --version and --help: fast, plain ----------------------------------------------------------


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["run", "--help"], ["check", "-h"], ["bench", "--help"]])
def test_help_and_version_load_no_onnx_and_read_as_plain_text(args):
    """Under a second (issue: ~3 s importing onnx): the parser is read without the op library."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "moe_onnx_command", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert not {
        m for m in imported if m.split(".")[0] in ("onnx", "numpy", "ml_dtypes", "onnxruntime", "moe_onnx.custom_ops")
    }
    assert "moe_onnx.custom_ops.schemas" not in imported
    assert "``" not in done.stdout and done.stdout.strip()
    if args == ["--version"]:
        assert done.stdout.strip() == f"moe-onnx {moe_onnx.__version__}"


def test_the_fast_path_leaves_a_real_command_alone(tmp_path):
    """An option value that reads like --help is not taken for it; the command runs as usual."""
    done = subprocess.run(
        [sys.executable, "-m", "moe_onnx_command", "check", str(tmp_path / "missing.onnx"), "--", "--help"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr


def test_the_license_is_stated_and_shipped():
    root = os.path.join(os.path.dirname(__file__), "..")
    with open(os.path.join(root, "LICENSE")) as f:
        head = f.read(300)
    assert "Apache License" in head and "Version 2.0, January 2004" in head
    import tomllib

    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["license"] == {"text": "Apache-2.0"}
