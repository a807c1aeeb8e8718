"""What a newcomer meets first: the version, help on everything, options and paths checked
before any work, ranks found from the files, clear one-line errors (once per job), the
``inputs`` and ``check`` commands, and folders for ``convert`` / ``lower``."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import moe_onnx
from moe_onnx.builders import single_node_model
from moe_onnx.commands import cli, launch
from moe_onnx.models import EP_LAYER_SMALL
from moe_onnx.models.ep_layer import LayerConfig, build_rank_model, make_weights
from tests.support import all_to_all_model


def run_cli(capsys, *args) -> tuple[int, str, str]:
    try:
        code = cli.main(list(args))
    except SystemExit as exit:  # argparse (--help, --version, a refused option)
        code = exit.code if isinstance(exit.code, int) else 2
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def layer_folder(folder, ranks: int = 2, pattern: str = "gather_index") -> str:
    config = LayerConfig(ranks=ranks)
    weights = make_weights(config, seed=0)
    os.makedirs(folder, exist_ok=True)
    for r in range(ranks):
        onnx.save(build_rank_model(config, weights, r, pattern), os.path.join(folder, f"rank{r}.onnx"))
    return str(folder)


# --- the basics -------------------------------------------------------------------------


def test_version_has_one_source(capsys):
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out.strip() == f"moe-onnx {moe_onnx.__version__}"
    assert importlib.metadata.version("moe-onnx") == moe_onnx.__version__  # pyproject reads it


def test_every_option_and_positional_has_help():
    def parsers(parser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from parsers(sub)

    missing = [
        f"{parser.prog} {action.dest}"
        for parser in parsers(cli.parser())
        for action in parser._actions
        if not action.help  # (argparse.SUPPRESS is help too: the launcher's own flag)
    ]
    assert missing == []


def test_py_typed_ships():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert os.path.isfile(os.path.join(root, "moe_onnx", "py.typed"))
    with open(os.path.join(root, "pyproject.toml")) as f:
        assert '"moe_onnx" = ["py.typed"]' in f.read()


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", EP_LAYER_SMALL, "--timeout", "-5"], "argument --timeout: must be a number of seconds > 0, got -5"),
        (["run", EP_LAYER_SMALL, "--timeout", "nan"], "argument --timeout: must be a number of seconds > 0"),
        (["run", EP_LAYER_SMALL, "--ranks", "0"], "argument --ranks: must be >= 1, got 0"),
        (["run", EP_LAYER_SMALL, "--seed", "-1"], "argument --seed: must be >= 0, got -1"),
        (["bench", "--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
        (["bench", "--shape", "huge"], "argument --shape: invalid choice: 'huge'"),
        (["check", EP_LAYER_SMALL, "--target", "ascend310"], "argument --target: invalid choice: 'ascend310'"),
    ],
)
def test_refused_options_are_one_line(capsys, args, message):
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and message in one_line(err)


def test_bench_op_without_a_case_is_refused_with_the_ops_that_have_one(capsys):
    began = time.monotonic()
    code, out, err = run_cli(capsys, "bench", "--op", "AllToAll")
    line = one_line(err)
    assert code == 2 and "--op 'AllToAll' has no benchmark case" in line and "MoeReRoutingV2" in line
    assert "AllToAll," not in line.split("the ops with one:")[1]
    assert "[1/" not in out and time.monotonic() - began < 30  # before anything is measured


# --- outputs checked before any work ----------------------------------------------------


def test_bench_outputs_are_checked_before_the_run(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("")
    cases = {
        ("--json", str(tmp_path / "file" / "x.json")): "file is a file, not a folder to write into",
        ("--markdown", str(tmp_path)): "exists and is not a file: it is a folder",
        ("--plot", str(tmp_path / "b.xyz")): "give a file ending in one of",
    }
    for (option, path), message in cases.items():
        code, out, err = run_cli(capsys, "bench", "--shape", "tiny", option, path)
        assert code == 2 and message in one_line(err) and "[1/" not in out, (option, err)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as without matplotlib
    code, out, err = run_cli(capsys, "bench", "--shape", "tiny", "--plot", str(tmp_path / "b.png"))
    assert code == 2 and "--plot needs matplotlib" in one_line(err) and "[1/" not in out


def test_run_outputs_onto_a_file_is_refused_before_the_run(tmp_path, capsys):
    (tmp_path / "out").write_text("")
    code, out, err = run_cli(capsys, "run", EP_LAYER_SMALL, "--outputs", str(tmp_path / "out"))
    assert code == 2 and "--outputs" in one_line(err) and "exists and is not a folder" in err
    assert "running" not in out


def test_bench_writes_into_a_folder_it_makes(tmp_path, capsys):
    code, _, err = run_cli(
        capsys, "bench", "--shape", "tiny", "--op", "MoeReRoutingV2", "--repeats", "1", "--no-stock",
        "--json", str(tmp_path / "new" / "b.json"),
    )  # fmt: skip
    assert code == 0, err
    assert [row["op"] for row in json.loads((tmp_path / "new" / "b.json").read_text())] == ["MoeReRoutingV2"]


# --- run: ranks from the files, inputs, errors once per job -----------------------------


def test_ranks_come_from_a_folder_or_a_pattern(tmp_path, capsys):
    folder = layer_folder(tmp_path / "layer", ranks=2)
    for model in (folder, str(tmp_path / "layer" / "rank{r}.onnx")):
        code, out, err = run_cli(capsys, "run", model, "--outputs", str(tmp_path / "out"))
        assert code == 0, err
        assert "running 2 rank(s)" in out and "rank 1: session ready" in out and "rank 1: done" in out
    assert sorted(os.listdir(tmp_path / "out")) == ["rank0.npz", "rank1.npz"]


def test_ranks_that_disagree_with_the_files_are_refused(tmp_path, capsys):
    folder = layer_folder(tmp_path / "layer", ranks=2)
    code, out, err = run_cli(capsys, "run", folder, "--ranks", "4")
    assert code == 2 and "--ranks 4, but MODEL" in one_line(err) and "has 2 rank file(s)" in err
    os.remove(tmp_path / "layer" / "rank0.onnx")
    code, _, err = run_cli(capsys, "run", folder)
    assert code == 2 and "rank0.onnx is missing" in one_line(err)


def test_one_file_runs_on_one_rank_unless_it_has_a_collective(tmp_path, capsys):
    tokens, counts = np.ones((3, 4), np.float32), np.array([[1, 2]], np.int32)
    onnx.save(
        single_node_model("MoeReRoutingV2", {"tokens": tokens, "expert_token_num_per_rank": counts}),
        tmp_path / "rr.onnx",
    )
    onnx.save(all_to_all_model(), tmp_path / "a2a.onnx")
    np.savez(tmp_path / "in0.npz", tokens=tokens, expert_token_num_per_rank=counts)
    code, out, err = run_cli(capsys, "run", str(tmp_path / "rr.onnx"), "--inputs", str(tmp_path / "in{r}.npz"))
    assert code == 0 and "running 1 rank(s)" in out, err
    code, _, err = run_cli(capsys, "run", str(tmp_path / "a2a.onnx"))
    assert code == 2 and "one file with collectives (cann.moe::AllToAll): say how many ranks" in one_line(err)


def test_inputs_writes_templates_run_takes(tmp_path, capsys):
    folder = layer_folder(tmp_path / "layer", ranks=2)
    code, out, err = run_cli(capsys, "inputs", folder, str(tmp_path / "in"))
    assert code == 0, err
    assert "wrote" in out and "x [8, 16] float32" in out
    with np.load(tmp_path / "in" / "rank1.npz") as data:
        assert data.files == [i.name for i in onnx.load(os.path.join(folder, "rank1.onnx")).graph.input]
        x = data["x"]
    np.savez(tmp_path / "in" / "rank1.npz", x=2 * x)  # edited
    code, _, err = run_cli(
        capsys, "run", folder, "--inputs", str(tmp_path / "in" / "rank{r}.npz"), "--outputs", str(tmp_path / "out")
    )
    assert code == 0, err
    generated = launch.rank_feeds(os.path.join(folder, "rank1.onnx"), None, 1, 0)["x"]
    assert np.array_equal(x, generated)  # the template is the batch run makes without --inputs


def test_inputs_files_that_are_not_npz_archives_say_so(tmp_path, capsys):
    onnx.save(build_rank_model(LayerConfig(ranks=1), make_weights(LayerConfig(ranks=1), 0), 0), tmp_path / "m.onnx")
    (tmp_path / "text0.npz").write_text("hello")
    np.save(tmp_path / "array0.npy", np.ones((4, 16), np.float32))
    np.savez(tmp_path / "objects0.npz", x=np.array([{"a": 1}], dtype=object))
    cases = {
        "text{r}.npz": "is not a .npz archive: --inputs takes .npz files keyed by graph input names",
        "array{r}.npy": "is a .npy file (one array, no names)",
        "objects{r}.npz": "holds object arrays: only numeric arrays can be fed",
    }
    for inputs, message in cases.items():
        args = ["run", str(tmp_path / "m.onnx"), "--ranks", "1", "--inputs", str(tmp_path / inputs)]
        code, _, err = run_cli(capsys, *args)
        line = one_line(err)
        assert code == 2 and message in line and "allow_pickle" not in line and "context manager" not in line


def test_refusals_are_said_once_per_job_with_a_hint_for_generated_inputs(tmp_path, capsys):
    onnx.save(all_to_all_model(), tmp_path / "a2a.onnx")
    code, _, err = run_cli(capsys, "run", str(tmp_path / "a2a.onnx"), "--ranks", "2")
    line = one_line(err)
    assert code == 2 and line.startswith("ranks 0, 1: error: MoeOpError: AllToAll node 'a2a': rank 0: send_counts")
    assert "(these inputs were generated" in line and "moe-onnx inputs MODEL DIR" in line


def test_external_data_outside_the_model_folder_is_one_line(tmp_path, capsys):
    weight = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    weight.data_location = TensorProto.EXTERNAL
    weight.ClearField("raw_data")
    entry = weight.external_data.add()
    entry.key, entry.value = "location", "../../../etc/passwd"
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])],
        [weight],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), tmp_path / "m.onnx")
    for args in (["run", "m.onnx"], ["convert", "m.onnx", "out.onnx"], ["lower", "m.onnx", "out.onnx"]):
        code, _, err = run_cli(capsys, *[str(tmp_path / a) if a.endswith(".onnx") else a for a in args])
        assert code == 2 and "keeps its data at '../../../etc/passwd', outside the model's folder" in one_line(err)
    assert sorted(os.listdir(tmp_path)) == ["m.onnx"]


# --- convert and lower take folders -----------------------------------------------------


@pytest.mark.parametrize("command", ["convert", "lower"])
def test_a_folder_of_ranks_goes_to_a_folder_it_makes(tmp_path, capsys, command):
    folder = layer_folder(tmp_path / "layer", ranks=2)
    code, out, err = run_cli(capsys, command, folder, str(tmp_path / "new" / "out"))
    assert code == 0, err
    assert sorted(os.listdir(tmp_path / "new" / "out")) == ["rank0.onnx", "rank1.onnx"]
    if command == "convert":
        assert out.count("1 converted") == 2
        assert (
            sum(n.op_type == "MoeReRoutingV2" for n in onnx.load(tmp_path / "new" / "out" / "rank1.onnx").graph.node)
            == 1
        )
    code, _, err = run_cli(capsys, command, folder, str(tmp_path / "pattern_{r}.onnx"))
    assert code == 0 and os.path.exists(tmp_path / "pattern_1.onnx"), err
    (tmp_path / "a_file").write_text("")
    code, _, err = run_cli(capsys, command, folder, str(tmp_path / "a_file"))
    assert code == 2 and "OUT" in one_line(err) and "holds 2 rank models" in err


def test_convert_writes_nothing_when_one_rank_is_refused(tmp_path, capsys):
    folder = layer_folder(tmp_path / "layer", ranks=2)
    (tmp_path / "layer" / "rank1.onnx").write_bytes(b"")
    code, _, err = run_cli(capsys, "convert", folder, str(tmp_path / "out"), "--json", str(tmp_path / "r.json"))
    assert code == 2 and "rank1.onnx is empty" in one_line(err)
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "r.json")


def test_convert_of_a_folder_reports_each_rank_in_the_json(tmp_path, capsys):
    folder = layer_folder(tmp_path / "layer", ranks=2)
    code, _, err = run_cli(capsys, "convert", folder, str(tmp_path / "out"), "--json", str(tmp_path / "r.json"))
    assert code == 0, err
    ranks = json.loads((tmp_path / "r.json").read_text())
    assert [os.path.basename(r["output"]) for r in ranks] == ["rank0.onnx", "rank1.onnx"]
    assert all(r["report"]["changed"] and r["report"]["all_to_all"] for r in ranks)


# --- check --------------------------------------------------------------------------------


def test_check_prints_each_nodes_npu_limits(tmp_path, capsys):
    tokens, counts = np.ones((6, 16384), np.int8), np.array([[2, 1], [1, 2]], np.int32)
    model = single_node_model("MoeReRoutingV2", {"tokens": tokens, "expert_token_num_per_rank": counts}, node_name="rr")
    onnx.save(model, tmp_path / "rr.onnx")
    code, out, _ = run_cli(capsys, "check", str(tmp_path / "rr.onnx"), "--target", "ascend910b")
    assert code == 1
    assert "node 'rr' (MoeReRoutingV2) on ascend910b: breaks 2 limit(s)" in out
    assert "ascend950 only" in out and "H = 16384 must satisfy 0 < H < 16384" in out
    code, out, _ = run_cli(capsys, "check", str(tmp_path / "rr.onnx"))  # every target
    assert code == 1 and out.count("node 'rr'") == 3 and "3 of 3 node-target pair(s)" in out


def test_check_of_a_folder_with_symbolic_dims_skips_what_it_cannot_decide(capsys):
    code, out, _ = run_cli(capsys, "check", EP_LAYER_SMALL, "--target", "ascend950")
    assert code == 0, out
    assert out.count("rank") >= 4 and "0 of" in out.splitlines()[-1]


def test_check_says_when_an_op_records_no_limit(tmp_path, capsys):
    onnx.save(all_to_all_model(), tmp_path / "a2a.onnx")
    code, out, _ = run_cli(capsys, "check", str(tmp_path / "a2a.onnx"), "--target", "ascend950")
    assert code == 0 and "node 'a2a' (AllToAll) on ascend950: no NPU limit recorded for this op" in out


# --- the torch frontend without torch ---------------------------------------------------


def test_moe_onnx_torch_without_torch_says_how_to_get_it():
    program = "import sys; sys.modules['torch'] = None\nimport moe_onnx.torch"
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "moe_onnx.torch needs PyTorch: pip install 'moe-onnx[torch]'" in result.stderr.splitlines()[-1]
