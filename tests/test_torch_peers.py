"""fairscale's and DeepSpeed's MoE layers export unchanged with moe_onnx's translation table
(their ``dist.all_to_all_single`` becomes ``cann.moe::AllToAll``) and the per-rank models run on
moe_onnx's ranks like the layers do eagerly.

Marked ``peers``: deselected by default; run with ``pytest -m peers`` where fairscale and
deepspeed are installed. Without them the test fails saying so (it is never skipped).
"""

from __future__ import annotations

import importlib

import numpy as np
import onnx
import pytest

pytestmark = pytest.mark.peers

WORLD = 2


def require(package: str) -> None:
    try:
        importlib.import_module(package)
    except ImportError as err:
        pytest.fail(f"the peers test needs {package} installed (pip install fairscale deepspeed): {err}")


@pytest.mark.parametrize("peer", ["fairscale", "deepspeed"])
def test_peer_moe_layer_exports_unchanged_and_runs_like_eager(tmp_path, peer):
    require(peer)
    from moe_onnx.ranks import run_threads
    from tests.torch_peers_worker import worker
    from tests.torch_ranks import start_ranks

    start_ranks(worker, WORLD, peer, str(tmp_path), directory=str(tmp_path))
    models = [str(tmp_path / f"rank{r}.onnx") for r in range(WORLD)]
    ops = [(n.domain, n.op_type) for n in onnx.load(models[0]).graph.node]
    assert ops.count(("cann.moe", "AllToAll")) == 2, ops
    eager = [dict(np.load(tmp_path / f"eager{r}.npz")) for r in range(WORLD)]
    for batch in ("0", "1"):  # the traced batch, then another of the same shape
        results = run_threads(models, [{"x": e[f"x{batch}"]} for e in eager])
        for rank, (y,) in enumerate(results):
            np.testing.assert_allclose(y, eager[rank][f"y{batch}"], rtol=1e-5, atol=1e-5)
