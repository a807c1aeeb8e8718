"""Every served torch_npu / cann_ops_transformer name under hostile arguments (SPEC-layer 1.18
amended, "inputs"): in a subprocess, so an abort fails the test instead of ending the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_hostile_arguments_are_refused_by_name_never_aborted_or_left_unwritten():
    result = subprocess.run(
        [sys.executable, "-m", "tests.npu_fuzz_worker"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]  # a crash (abort, segfault) ends here
    report = json.loads(result.stdout.strip().splitlines()[-1])
    counts = report["counts"]
    assert set(counts) <= {"ran", "refused"}, report["examples"]  # no bare error, no unwritten output
    assert counts["refused"] >= 700, counts  # the fuzz reached every name's arguments
    print(counts)


def test_each_kind_of_bad_argument_is_named_with_its_rule():
    import pytest
    import torch

    import moe_onnx
    import moe_onnx.torch as mt
    from moe_onnx.torch import npu, ops_transformer

    x, counts = torch.randn(4, 8), torch.tensor([[2, 2]], dtype=torch.int32)
    idx = torch.zeros(4, 2, dtype=torch.int32)
    cases = [
        (
            lambda: npu.npu_moe_re_routing(x, counts.to("meta")),
            "npu_moe_re_routing: argument expert_token_num_per_rank: the tensor is on meta",
        ),
        (
            lambda: npu.npu_moe_re_routing("x", counts),
            "npu_moe_re_routing: argument tokens: a tensor goes here, got str",
        ),
        (lambda: npu.npu_moe_gating_top_k(x, 1.5), "npu_moe_gating_top_k: argument k: 1.5 is not a whole number"),
        (lambda: npu.npu_moe_init_routing_v2(x, idx, expert_num=None), "argument expert_num: None is not a value here"),
        (lambda: npu.npu_grouped_matmul([], [x], group_type=0), "argument x: at least one tensor goes here"),
        (
            lambda: npu.npu_moe_init_routing_v2(x, idx, expert_num=4, active_expert_range=[1, 2, 3]),
            "argument active_expert_range: 2 values (or none) go here, got 3",
        ),
        (
            lambda: npu.npu_swiglu(x.to(torch.complex64)),
            "npu_swiglu: argument input: dtype torch.complex64 is not supported",
        ),
        (
            lambda: ops_transformer.NAMES["moe_init_routing"](x, idx.to("meta"), expert_num=4),
            "cann_ops_transformer.moe_init_routing: argument expert_idx",
        ),
        (
            lambda: mt.moe_re_routing_v2(x, counts.to("meta")),
            "MoeReRoutingV2: input expert_token_num_per_rank: the tensor is on meta",
        ),
    ]
    for call, message in cases:
        with pytest.raises(moe_onnx.MoeOpError) as caught:
            call()
        assert message in str(caught.value)
