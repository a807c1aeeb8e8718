"""The commands refuse bad files and inputs in one line with exit code 2 (a traceback only
with --debug), and an interrupted write leaves nothing behind: no partial output, no orphan
data file, no hidden temporary model."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import moe_onnx
from moe_onnx.commands import model_files
from moe_onnx.commands.cli import main
from moe_onnx.commands.launch import save_outputs
from moe_onnx.models.ep_layer import LayerConfig, build_rank_model, make_weights
from tests.support import all_to_all_model


def run_cli(capsys, *args) -> tuple[int, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.err


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def layer_model(path, external: bool = False, hidden: int = 16, ffn: int = 32) -> None:
    config = LayerConfig(ranks=1, hidden=hidden, ffn=ffn)
    model = build_rank_model(config, make_weights(config, seed=0), 0)
    if external:
        onnx.save(model, path, save_as_external_data=True, location=os.path.basename(path) + ".data", size_threshold=0)
    else:
        onnx.save(model, path)


def snapshot(folder) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder)) if (folder / name).is_file()}


# --- moe-onnx convert and lower: a model file from a model file -------------------------

WRITERS = ["convert", "lower"]


@pytest.fixture
def source(tmp_path):
    layer_model(tmp_path / "in.onnx", external=True)
    return tmp_path / "in.onnx"


@pytest.mark.parametrize("command", WRITERS)
def test_refuses_links_to_its_input(tmp_path, source, capsys, command):
    before = snapshot(tmp_path)
    os.symlink(source, tmp_path / "symlink.onnx")
    os.link(source, tmp_path / "hardlink.onnx")
    os.symlink(tmp_path, tmp_path.parent / f"{tmp_path.name}_linked")  # the same folder by another name
    through_folder = tmp_path.parent / f"{tmp_path.name}_linked" / "in.onnx"
    for out in (source, tmp_path / "symlink.onnx", tmp_path / "hardlink.onnx", through_folder):
        code, err = run_cli(capsys, command, str(source), str(out))
        assert code == 2 and "is the input model" in one_line(err)
    assert snapshot(tmp_path) == {**before, "hardlink.onnx": before["in.onnx"], "symlink.onnx": before["in.onnx"]}
    assert os.path.islink(tmp_path / "symlink.onnx")
    os.remove(tmp_path.parent / f"{tmp_path.name}_linked")


@pytest.mark.parametrize("command", WRITERS)
def test_refuses_an_output_whose_data_file_is_the_inputs(tmp_path, capsys, command):
    """IN keeps its weights in ``out.onnx.data``: writing ``out.onnx`` would replace them."""
    config = LayerConfig(ranks=1)
    model = build_rank_model(config, make_weights(config, seed=0), 0)
    onnx.save(model, tmp_path / "in.onnx", save_as_external_data=True, location="out.onnx.data", size_threshold=0)
    before = snapshot(tmp_path)
    code, err = run_cli(capsys, command, str(tmp_path / "in.onnx"), str(tmp_path / "out.onnx"))
    assert code == 2 and "OUT's data file" in one_line(err) and "the input's external data" in err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("command", WRITERS)
@pytest.mark.parametrize("content", [b"", b"\x08\x96\x01garbage\xff\xff", b"\x08\x07"])  # empty, corrupt, no graph
def test_refuses_what_is_not_a_model(tmp_path, capsys, content, command):
    (tmp_path / "in.onnx").write_bytes(content)
    code, err = run_cli(capsys, command, str(tmp_path / "in.onnx"), str(tmp_path / "out.onnx"))
    assert code == 2 and "in.onnx" in one_line(err)
    assert sorted(os.listdir(tmp_path)) == ["in.onnx"]


@pytest.mark.parametrize("command", WRITERS)
def test_refuses_an_output_that_is_not_a_file(tmp_path, source, capsys, command):
    """A rename would replace a device's entry (root could replace /dev/null) or a folder (an
    existing folder as OUT means OUT/<IN's name>: tests/test_cli_guidance.py)."""
    (tmp_path / "out.onnx.data").mkdir()
    (tmp_path / "a_file").write_text("")
    os.mkfifo(tmp_path / "fifo.onnx")  # a special file anyone can make
    before = sorted(os.listdir(tmp_path))
    for out, why in [
        (tmp_path / "fifo.onnx", "exists and is not a file"),
        (tmp_path / "out.onnx", "exists and is not a file"),  # its data file is a folder
        (tmp_path / "a_file" / "out.onnx", "a_file is a file, not a folder to write into"),
        (tmp_path / "a_file" / "sub" / "out.onnx", "a_file is a file, so the folder"),
    ]:
        code, err = run_cli(capsys, command, str(source), str(out))
        assert code == 2 and why in one_line(err), err
    assert sorted(os.listdir(tmp_path)) == before


def test_lower_refuses_an_opset_below_the_bodies_in_one_line(tmp_path, capsys):
    """(A model with nothing to lower passes through at any opset: tests/test_cli_guidance.py.)"""
    model = moe_onnx.single_node_model("SwiGlu", {"x": np.ones((2, 4), np.float32)}, opset=17)
    onnx.save(model, tmp_path / "in.onnx")
    code, err = run_cli(capsys, "lower", str(tmp_path / "in.onnx"), str(tmp_path / "out.onnx"))
    assert code == 2 and "must be >= 18" in one_line(err)
    assert sorted(os.listdir(tmp_path)) == ["in.onnx"]


@pytest.mark.parametrize("command", WRITERS)
def test_debug_shows_the_traceback(tmp_path, capsys, command):
    code, err = run_cli(capsys, command, "--debug", str(tmp_path / "missing.onnx"), str(tmp_path / "out.onnx"))
    assert code == 2 and "Traceback" in err and "does not exist" in err


@pytest.mark.parametrize("command", WRITERS)
@pytest.mark.parametrize("interrupt", [signal.SIGTERM, signal.SIGINT])
def test_interrupted_write_leaves_no_partial_output(tmp_path, source, monkeypatch, capsys, interrupt, command):
    """The signal arrives while the data file is half written: neither OUT nor OUT.data
    appears, an existing OUT stays as it was, and the staging folder is removed."""
    onnx.save(all_to_all_model(), tmp_path / "out.onnx")  # the previous output
    before = snapshot(tmp_path)
    real_save = ir.save

    def save_then_signal(model, path, external_data=None):
        real_save(model, path, external_data=external_data)
        assert os.path.exists(os.path.join(os.path.dirname(path), external_data))
        os.kill(os.getpid(), interrupt)
        time.sleep(1)  # the handler runs at the next bytecode; this is never reached in full

    monkeypatch.setattr(model_files.ir, "save", save_then_signal)
    code, err = run_cli(capsys, command, str(source), str(tmp_path / "out.onnx"))
    assert code == 128 + interrupt and f"interrupted ({interrupt.name})" in one_line(err)
    assert snapshot(tmp_path) == before
    assert sorted(os.listdir(tmp_path)) == sorted(before)  # no hidden staging folder either
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.parametrize("command", WRITERS)
def test_writes_model_and_data_into_place(tmp_path, source, capsys, command):
    code, _ = run_cli(capsys, command, str(source), str(tmp_path / "out.onnx"))
    assert code == 0
    assert sorted(os.listdir(tmp_path)) == ["in.onnx", "in.onnx.data", "out.onnx", "out.onnx.data"]
    onnx.checker.check_model(str(tmp_path / "out.onnx"), full_check=True)


# --- moe-onnx run ----------------------------------------------------------------------


def test_run_refusals_are_one_line(tmp_path, capsys):
    layer_model(tmp_path / "m.onnx")
    np.savez(tmp_path / "wrong0.npz", x=np.ones((4, 5), np.float32))  # H = 5, the model's is 16
    (tmp_path / "garbage0.npz").write_bytes(b"not a zip file")
    np.savez(tmp_path / "objects0.npz", x=np.array([{"a": 1}], dtype=object))
    (tmp_path / "empty.onnx").write_bytes(b"")
    cases = {
        str(tmp_path / "missing.onnx"): ("model file", None),
        str(tmp_path / "empty.onnx"): ("is not an ONNX model", None),
        "garbage": ("is not a .npz archive", str(tmp_path / "garbage{r}.npz")),
        "objects": ("holds object arrays", str(tmp_path / "objects{r}.npz")),
        "missing inputs": ("inputs file", str(tmp_path / "nothing{r}.npz")),
        "wrong shape": ("rank 0: error: FeedError: input 'x' must have shape ['T', 16], got [4, 5]", None),
    }
    for model, (message, inputs) in cases.items():
        if not model.endswith(".onnx"):
            model, inputs = str(tmp_path / "m.onnx"), inputs or str(tmp_path / "wrong{r}.npz")
        args = ["run", model, "--ranks", "1"] + (["--inputs", inputs] if inputs else [])
        code, err = run_cli(capsys, *args)
        assert code == 2 and message in one_line(err), (model, inputs, err)


def test_run_moe_op_error_on_a_rank_is_a_refusal(tmp_path, capsys):
    onnx.save(all_to_all_model(), tmp_path / "a2a.onnx")
    for r, counts in enumerate(([1, 1], [1, 2])):
        np.savez(tmp_path / f"in{r}.npz", data=np.ones((2, 3), np.float32), send_counts=np.array(counts))
    args = ["run", str(tmp_path / "a2a.onnx"), "--ranks", "2", "--inputs", str(tmp_path / "in{r}.npz")]
    code, err = run_cli(capsys, *args)
    assert code == 2, err
    # once per job: both ranks raised it, rank 0 "reported by rank 1"
    assert one_line(err).startswith("ranks 0, 1: error: MoeOpError: AllToAll node 'a2a': rank 1: sum(send_counts) = 3")
    assert "reported by" not in err
    code, err = run_cli(capsys, *args, "--debug")
    assert code == 2 and "Traceback" in err


def test_run_mismatched_collectives_fail_with_code_1(tmp_path, capsys):
    onnx.save(all_to_all_model(), tmp_path / "rank0.onnx")
    onnx.save(all_to_all_model(with_all_to_all=False), tmp_path / "rank1.onnx")
    for r in range(2):
        np.savez(tmp_path / f"in{r}.npz", data=np.ones((2, 3), np.float32), send_counts=np.array([1, 1]))
    code, err = run_cli(capsys, "run", str(tmp_path), "--ranks", "2", "--inputs", str(tmp_path / "in{r}.npz"))
    assert code == 1
    assert one_line(err).startswith("ranks 0, 1: error: CollectiveMismatch: ")


def test_bench_unknown_op_is_refused(capsys):
    code, err = run_cli(capsys, "bench", "--op", "NoSuchOp", "--shape", "tiny")
    line = one_line(err)
    assert code == 2 and "--op 'NoSuchOp' has no benchmark case; the ops with one: " in line
    assert "MoeInitRoutingV2," in line


def test_outputs_of_any_name_are_saved(tmp_path):
    names = ["file", "allow_pickle", "y"]
    values = [np.arange(3, dtype=np.float32), np.ones((2, 2), np.int64), np.zeros(0, np.int8)]
    save_outputs(str(tmp_path), 0, names, values)
    with np.load(tmp_path / "rank0.npz") as saved:
        assert saved.files == names
        for name, value in zip(names, values):
            assert saved[name].dtype == value.dtype and np.array_equal(saved[name], value)
    assert os.listdir(tmp_path) == ["rank0.npz"]


# --- the hidden temp model of an external-data model -----------------------------------

CREATE_SESSIONS = """
import sys, time, moe_onnx
end = time.monotonic() + 60
while time.monotonic() < end:
    moe_onnx.InferenceSession(sys.argv[1], executor="pyop")
"""


@pytest.mark.parametrize("interrupt", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_session_creation_leaves_no_temp_model(tmp_path, interrupt):
    """The signal is sent the moment the hidden ``.moe_onnx_*.onnx`` appears (onnxruntime is
    reading it): the process still ends by that signal, and the file is gone."""
    layer_model(tmp_path / "m.onnx", external=True, hidden=512, ffn=1024)  # weights over 1 MiB stay external
    child = subprocess.Popen([sys.executable, "-c", CREATE_SESSIONS, str(tmp_path / "m.onnx")])
    try:
        while not glob.glob(str(tmp_path / ".moe_onnx_*")):
            assert child.poll() is None, "the child ended before it wrote a temp model"
            time.sleep(0.001)
        child.send_signal(interrupt)
        child.wait(60)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode in (-interrupt, 1)  # 1: KeyboardInterrupt's exit in some Pythons
    assert not glob.glob(str(tmp_path / ".moe_onnx_*"))


def test_exit_code_counts_the_ranks_that_failed_first():
    from moe_onnx import MoeOpError
    from moe_onnx.commands.launch import exit_code
    from moe_onnx.ranks import PeerStopped

    peer = PeerStopped("rank 0 stopped: rank 1 failed: ...")
    assert exit_code({0: peer, 1: MoeOpError("counts do not sum")}) == 2
    assert exit_code({0: peer, 1: RuntimeError("rank 1 stopped: rank 2 did not reach AllToAll within 5 s")}) == 1
    assert exit_code({0: peer}) == 1
