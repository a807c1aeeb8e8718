"""MindSpeed's mc2 expert path (``moe_feature/mc2moe``) run unchanged on gloo ranks
(tests/test_mindspeed_mc2_peers.py, ``-m peers``).

Copied at test time into a temporary folder, never into this repository, from a checkout
named by ``$MINDSPEED``, else from the bare git mirror ``$MINDSPEED_GIT`` (default
:data:`DEFAULT_MIRROR`) at ``HEAD`` (:data:`FILES`), and run as they are:

* ``mindspeed/core/transformer/moe/moe_feature/mc2moe/mc2_fuse_a2a.py``: ``AlltoallvPermuteGmm``
  (FC1: ``npu_alltoallv_gmm`` with ``permute_out_flag=True``; backward ``npu_gmm_alltoallv``
  with W rearranged ``n h f -> n f h`` and the lists swapped, dW by ``npu_grouped_matmul``
  ``group_type=2``) and ``GmmUnpermuteAlltoallv`` (FC2: ``npu_gmm_alltoallv``; backward
  ``npu_alltoallv_gmm``), the only MindSpeed code that calls the MC2 grouped matmuls;
* ``mindspeed/core/fusions/fused_bias_swiglu.py``: ``fused_swiglu`` (``npu_swiglu``), the
  activation ``GmmExpertsMC2Impl`` sets for a gated MLP;
* ``mindspeed/core/transformer/moe/comm_utils.py``: ``AsyncAllToAllWithBackward``, with which
  ``MoEAlltoAllMC2TokenDispatcher.token_permutation`` sends the permuted probabilities.

:func:`mc2_moe` calls them on the installed megatron-core (0.19), on which MindSpeed's
``moe_feature/__init__`` does not import (``grouped_gemm_util``, ``GroupedMLP``, ... are gone),
so it follows the rest of ``GmmExpertsMC2Impl.forward`` / ``MoEAlltoAllMC2TokenDispatcher``
itself: the counts by ``routing_map.sum(0)`` and an ``all_to_all_single``, Megatron's own
``permute`` / ``unpermute`` (megatron-core's ``moe_utils``, imported unchanged), the probabilities
exchanged and sorted by local expert, the two Functions called with ``experts.py``'s exact
arguments.

The whole layer (:func:`copy_layer_sources`, :func:`install_layer`, :func:`mc2_layer`): MindSpeed
HEAD's ``mindspeed/`` package with Megatron-LM core_v0.12.1's ``megatron/core``,
``megatron/training`` and ``megatron/legacy`` (MindSpeed HEAD's README: "Mcore版本 0.12.1"), copied
from their mirrors into the test's temporary folder and first on ``sys.path`` inside the rank
processes only; Megatron's ``MoELayer`` becomes ``MindSpeedAlltoAllMC2MoeLayerAdaptor`` through
MindSpeed's own feature patches, and router, dispatcher (``alltoall`` or ``alltoall_seq``) and
``GmmExpertsMC2Impl`` all run as written. What that needs besides is listed in
``test_mindspeed_mc2_layer_trains_like_megatron_style_torch``'s docstring.

Stubbed (plumbing only, no arithmetic): ``torch.cuda.current_device()`` (where
``AsyncAllToAllWithBackward`` allocates: the CPU), ``torch.device("npu")`` (torch_npu renames the
privateuse1 backend, :func:`install` does the same) and ``ProcessGroup._get_backend(npu)``,
whose ``get_hccl_comm_name(rank)`` returns a name registered for the group with
:func:`moe_onnx.torch.collectives.register_group` (on the device: the HCCL communicator's).
``einops`` must be installed (MindSpeed's backward calls ``rearrange``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from tests.cann_recipes import copy_sources

DEFAULT_MIRROR = "/work/.mirror/Ascend+MindSpeed/repo"
FILES = {
    path: path
    for path in (
        "mindspeed/core/transformer/moe/moe_feature/mc2moe/mc2_fuse_a2a.py",
        "mindspeed/core/fusions/fused_bias_swiglu.py",
        "mindspeed/core/transformer/moe/comm_utils.py",
    )
}


def copy_mindspeed_mc2(dest: Path) -> str:
    """Copy :data:`FILES` under ``dest``; returns where they came from."""
    return copy_sources(
        dest,
        FILES,
        checkout_env="MINDSPEED",
        mirror_env="MINDSPEED_GIT",
        default_mirror=DEFAULT_MIRROR,
        repository="Ascend/MindSpeed",
    )


def install(source_dir: Path) -> None:
    """torch_npu's stand-in, the ``npu`` device name, the HCCL name of a process group, and
    the copied files importable. Call before ``init_process_group``."""
    import moe_onnx.torch as mt
    from moe_onnx.torch.collectives import register_group

    mt.install_stand_ins()
    torch.utils.rename_privateuse1_backend("npu")  # what importing torch_npu does
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]  # the device is the CPU
    plain_get_backend = dist.ProcessGroup._get_backend
    registered: dict[str, object] = {}

    def get_backend(group, device):
        """On ``npu``: an object whose ``get_hccl_comm_name(rank)`` names ``group``."""
        if torch.device(device).type != "npu":
            return plain_get_backend(group, device)
        name = "hccl_" + "_".join(str(r) for r in dist.get_process_group_ranks(group))
        if name not in registered:
            register_group(name, group)
            registered[name] = group
        return SimpleNamespace(get_hccl_comm_name=lambda rank: name)

    dist.ProcessGroup._get_backend = get_backend  # type: ignore[method-assign]
    sys.path.insert(0, str(source_dir))


def expert_counts(routing_map: torch.Tensor, group) -> tuple[list[int], list[int]]:
    """MoEAlltoAllMC2TokenDispatcher.preprocess: send_counts[e] = rows this rank routes to
    global expert e (= dst * E_l + le); recv_counts[src * E_l + le] by an all_to_all_single of
    those (one count per expert each way)."""
    send = routing_map.sum(dim=0).long()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return send.tolist(), recv.tolist()


def exchange_probs(permuted_probs, send_counts, recv_counts, group):
    """MoEAlltoAllMC2TokenDispatcher.token_permutation for the probabilities: MindSpeed's
    ``AsyncAllToAllWithBackward`` by rank (output / input splits: the rows from / to each EP
    rank), then Megatron's chunks [src, le] re-sorted to [le, src]
    (``sort_input_by_local_experts``), as written there."""
    from mindspeed.core.transformer.moe.comm_utils import AsyncAllToAllWithBackward

    world = dist.get_world_size(group)
    send = torch.tensor(send_counts).reshape(world, -1)
    recv = torch.tensor(recv_counts).reshape(world, -1)
    output_splits, input_splits = recv.sum(1).tolist(), send.sum(1).tolist()
    _, global_probs, handle = AsyncAllToAllWithBackward.apply(permuted_probs, output_splits, input_splits, group)
    handle.wait()
    local = recv.shape[1]
    sort_input_by_local_experts = torch.arange(world * local).reshape(world, local).T.ravel()
    global_probs = torch.split(global_probs, recv.ravel().tolist(), dim=0)
    return torch.cat([global_probs[i] for i in sort_input_by_local_experts.tolist()], dim=0)


def mc2_moe(x, probs, routing_map, w1, w2, group):
    """One MoE layer on MindSpeed's mc2 path, as AlltoAllMC2MoeLayer runs it after the router:
    x [T, H], probs [T, E] (zero off the top-k), routing_map [T, E] bool, this rank's experts
    w1 [E_l, H, 2F] and w2 [E_l, F, H] -> [T, H]. ``group``: the expert-parallel group."""
    from megatron.core.transformer.moe.moe_utils import permute, unpermute
    from mindspeed.core.fusions.fused_bias_swiglu import fused_swiglu
    from mindspeed.core.transformer.moe.moe_feature.mc2moe.mc2_fuse_a2a import (
        AlltoallvPermuteGmm,
        GmmUnpermuteAlltoallv,
    )

    world = dist.get_world_size(group)
    send_counts, recv_counts = expert_counts(routing_map, group)
    tokens_per_expert = torch.tensor(recv_counts).reshape(world, -1).sum(0)
    permuted, permuted_probs, mapping, *_ = permute(x, routing_map, probs=probs, num_out_tokens=int(routing_map.sum()))
    global_probs = exchange_probs(permuted_probs, send_counts, recv_counts, group)
    # GmmExpertsMC2Impl.forward, its arguments as written there
    mm1_out, _ = AlltoallvPermuteGmm.apply(
        permuted, w1, group, tokens_per_expert, None, None, None, send_counts, recv_counts
    )
    intermediate = (fused_swiglu(mm1_out) * global_probs.unsqueeze(-1)).to(mm1_out.dtype)  # activation_func_with_probs
    up_out, _ = GmmUnpermuteAlltoallv.apply(
        intermediate, w2, group, tokens_per_expert, None, None, None, send_counts, recv_counts
    )
    return unpermute(up_out, mapping, restore_shape=x.shape, routing_map=routing_map)


# --- the whole layer: MindSpeed's AlltoAllMC2MoeLayer on Megatron core_v0.12.1 ----------------

MEGATRON_MIRROR = "/work/.mirror/NVIDIA+Megatron-LM/repo"
MEGATRON_REVISION = "core_v0.12.1"  # MindSpeed HEAD's README: "Mcore版本 0.12.1", `git checkout core_v0.12.1`
TREES = {
    "Ascend/MindSpeed": ("MINDSPEED", "MINDSPEED_GIT", DEFAULT_MIRROR, "HEAD", ("mindspeed",)),
    "NVIDIA/Megatron-LM": (
        "MEGATRON_LM",
        "MEGATRON_LM_GIT",
        MEGATRON_MIRROR,
        MEGATRON_REVISION,
        ("megatron/core", "megatron/training", "megatron/legacy"),
    ),
}
# The overlap feature's modules (``--moe-alltoall-overlap-comm``, which MoEAlltoAllMC2Feature
# declares incompatible with ``--moe-alltoall-mc2``): ``moe_feature/adaptor.py`` imports their
# classes only to define its other adaptors; importing them needs transformer_engine (through
# fb_overlap -> mindspeed.core.fp8_utils) and ``torch_npu.utils.collect_env``. Empty classes here.
OVERLAP_PLACEHOLDERS = {
    "mindspeed.core.transformer.moe.moe_feature.overlap.moe_layer": (
        "AlltoAllSeqOverlapMoeLayer",
        "AllGatherOverlapMoeLayer",
        "AlltoAllOverlapMoeLayer",
    ),
    "mindspeed.core.transformer.moe.moe_feature.overlap.token_dispatcher": (
        "MoEAlltoAllSeqOverLapDispatcher",
        "MoEAllGatherOverLapDispatcher",
        "MoEAlltoAllOverLapDispatcher",
    ),
    "mindspeed.core.transformer.moe.moe_feature.overlap.experts": (
        "OverLapGmmExpertsImpl",
        "AlltoAllOverLapGmmExpertsImpl",
    ),
}
COUNTED = ("npu_alltoallv_gmm", "npu_gmm_alltoallv", "npu_grouped_matmul", "npu_swiglu")


def copy_layer_sources(dest: Path) -> list[str]:
    """MindSpeed's ``mindspeed`` package (HEAD) and Megatron-LM's ``megatron/core`` and
    ``megatron/training`` at :data:`MEGATRON_REVISION` under ``dest`` (``megatron`` made a regular
    package, so the installed megatron-core never mixes in); each from a checkout
    (``$MINDSPEED``, ``$MEGATRON_LM``) or a bare git mirror (``$MINDSPEED_GIT``,
    ``$MEGATRON_LM_GIT``). Returns where they came from; :class:`SourceMissing` otherwise."""
    import io
    import os
    import shutil
    import subprocess
    import tarfile

    from tests.cann_recipes import SourceMissing

    origins = []
    for repository, (checkout_env, mirror_env, default, revision, paths) in TREES.items():
        checkout = os.environ.get(checkout_env)
        if checkout:
            for path in paths:
                if not (Path(checkout) / path).is_dir():
                    raise SourceMissing(f"${checkout_env}={checkout} has no {path}/ (a {repository} checkout)")
                shutil.copytree(Path(checkout) / path, dest / path)
            origins.append(checkout)
            continue
        mirror = os.environ.get(mirror_env, default)
        run = subprocess.run(["git", "--git-dir", mirror, "archive", revision, *paths], capture_output=True)
        if run.returncode != 0:
            raise SourceMissing(
                f"cannot archive {revision}:{' '.join(paths)} from the git mirror {mirror} "
                f"({run.stderr.decode().strip()}): set ${checkout_env} to a checkout of {repository} "
                f"at {revision}, or ${mirror_env} to a bare clone"
            )
        with tarfile.open(fileobj=io.BytesIO(run.stdout)) as archive:
            archive.extractall(dest, filter="data")
        origins.append(f"{mirror} at {revision}")
    (dest / "megatron" / "__init__.py").touch()
    return origins


class _Stream:
    """A device stream where there is none (torch.cuda's, as Megatron's dispatcher asks)."""

    def synchronize(self):
        pass

    def wait_stream(self, other):
        pass

    def __eq__(self, other):
        return isinstance(other, _Stream)

    def __hash__(self):
        return 0


def _graph_mode_stubs():
    """Import hook: ``torchair.ge`` / ``torchair.ge_concrete_graph`` (the GE graph converters that
    MindSpeed's op builders register at import) as modules of no-ops."""
    import importlib.abc
    import importlib.machinery
    from types import ModuleType

    from tests.cann_recipes import Anything

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[:2] in (["torchair", "ge"], ["torchair", "ge_concrete_graph"]):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            module = ModuleType(spec.name, "stub: torchair's GE graph mode (tests/mindspeed_mc2_peers.py)")
            module.__path__ = []  # type: ignore[attr-defined]
            module.__getattr__ = lambda attr: Anything()  # type: ignore[attr-defined]
            module.register_fx_node_ge_converter = lambda *args, **kwargs: lambda converter: converter  # type: ignore[attr-defined]
            return module

        def exec_module(self, module):
            pass

    return Finder()


def install_layer(source_dir: Path) -> dict[str, int]:
    """:func:`install`, and what the whole layer needs besides (plumbing, each named in
    tests/test_mindspeed_mc2_peers.py); then MindSpeed's own patches, as its features register
    them: ``torch.compile`` -> ``dummy_compile`` (RequirementsBasicFeature, before Megatron is
    imported), GroupedMatmulFeature's and MoEAlltoAllMC2Feature's (Megatron's ``MoELayer`` ->
    ``MindSpeedAlltoAllMC2MoeLayerAdaptor``). Call before ``init_process_group``. Returns the
    count of calls of each of :data:`COUNTED` (filled as they run)."""
    import contextlib
    from argparse import Namespace
    from types import ModuleType

    install(source_dir)
    torch_npu = sys.modules["torch_npu"]
    npu = ModuleType("torch_npu.npu", "stub: torch_npu's device module (tests/mindspeed_mc2_peers.py)")
    npu._lazy_call = torch.cuda._lazy_call  # type: ignore[attr-defined]  # MindSpeed's RNG tracker imports these
    npu.device = torch.cuda.device  # type: ignore[attr-defined]
    sys.modules["torch_npu.npu"] = torch_npu.npu = npu
    torch_npu.__file__ = str(source_dir / "torch_npu" / "__init__.py")  # op builders read the package's folder
    sys.meta_path.insert(0, _graph_mode_stubs())
    torch.cuda.Stream = _Stream  # type: ignore[misc, assignment]
    torch.cuda.current_stream = lambda device=None: _Stream()  # type: ignore[assignment]
    torch.cuda.stream = lambda stream: contextlib.nullcontext()  # type: ignore[assignment]
    for name, classes in OVERLAP_PLACEHOLDERS.items():
        placeholder = ModuleType(name, "placeholder: the overlap feature (tests/mindspeed_mc2_peers.py)")
        placeholder.__dict__.update({c: type(c, (), {}) for c in classes})
        sys.modules[name] = placeholder
    counts = dict.fromkeys(COUNTED, 0)
    for name in COUNTED:
        real = getattr(torch_npu, name)

        def counted(*args, _name=name, _real=real, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        setattr(torch_npu, name, counted)

    from mindspeed.core.megatron_basic.requirements_basic import dummy_compile
    from mindspeed.patch_utils import MindSpeedPatchesManager as patches

    patches.register_patch("torch.compile", dummy_compile)
    patches.apply_patches()

    from megatron.training import global_vars

    global_vars.set_args(Namespace(recompute_activation_function=False))  # what should_recompute_activation reads
    from mindspeed.features_manager.fusions.grouped_matmul import GroupedMatmulFeature
    from mindspeed.features_manager.moe.moe_alltoall_mc2 import MoEAlltoAllMC2Feature

    args = Namespace(moe_token_dispatcher_type="alltoall", moe_alltoall_mc2=True)
    GroupedMatmulFeature().register_patches(patches, args)
    MoEAlltoAllMC2Feature().register_patches(patches, args)

    def host_copy(tensor, as_numpy=False, record_stream=False):
        """maybe_move_tensor_to_cpu where the device is the CPU: the splits arrive as numpy."""
        return tensor.numpy() if torch.is_tensor(tensor) and as_numpy else tensor

    patches.register_patch("megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu", host_copy)
    patches.apply_patches()
    return counts


def mc2_layer(config_overrides: dict):
    """Megatron's ``MoELayer`` (MindSpeed's ``MindSpeedAlltoAllMC2MoeLayerAdaptor`` after
    :func:`install_layer`) from a TransformerConfig of ``config_overrides`` (the dispatcher type
    among them: ``alltoall`` or ``alltoall_seq``) with grouped GEMM, SwiGLU, no bias; MindSpeed's
    overlap flags off."""
    import torch.nn.functional as F
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        num_attention_heads=4,
        moe_grouped_gemm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        **config_overrides,
    )
    config.moe_alltoall_overlap_comm = False  # MindSpeed's arguments, carried on its config
    config.moe_allgather_overlap_comm = False
    return MoELayer(config)
