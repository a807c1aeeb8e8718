"""The op library's ``Communicator`` on ``torch.distributed`` (the default group; gloo on CPU).

With it the AllToAll and AllGather kernels run eagerly between torch processes exactly as
they run between onnxruntime ranks: each rank first shares its verdict on its own input, so
a bad input on one rank is the same ``MoeOpError`` on every rank.

An op with ``group_ranks`` runs on the torch process group of those ranks
(:meth:`TorchCommunicator.group`): one the program made with ``torch.distributed.new_group``
(DeepSpeed's expert-parallel groups, megatron-core's ETP group). Such groups are consistent by
construction (``new_group`` is collective), so unlike the thread and MPI ranks only the
group's members take part, as in torch's own collectives.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ..custom_ops.all_to_all import check_labels
from ..custom_ops.errors import MoeOpError


class TorchCommunicator:
    """``allgather`` of small Python objects and ``alltoallv`` of byte rows on a process group.

    Every wait lasts as long as the group's timeout allows
    (``torch.distributed.init_process_group(timeout=...)``)."""

    def __init__(self, group=None):
        self.process_group = group
        self.world = dist.group.WORLD  # (a re-initialised default group is another object)
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.collectives = 0  # numbered across calls, for CollectiveMismatch's message

    def allgather(self, value: object, label: str) -> list:
        """Every rank's ``value``; :class:`~moe_onnx.custom_ops.all_to_all.CollectiveMismatch`
        on every rank if their ``label`` (what the collective is) differ."""
        self.collectives += 1
        gathered: list = [None] * self.size
        dist.all_gather_object(gathered, (label, value), group=self.process_group)
        check_labels([entry_label for entry_label, _ in gathered], self.collectives)
        return [entry_value for _, entry_value in gathered]

    def alltoallv(self, send: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray) -> np.ndarray:
        """Rows of a 2-D uint8 array: ``send_counts[d]`` rows to rank d, ``recv_counts[s]`` from rank s."""
        recv = torch.empty((int(recv_counts.sum()), send.shape[1]), dtype=torch.uint8)
        if send.shape[1]:  # rows of zero bytes: nothing to move
            dist.all_to_all_single(
                recv,
                torch.from_numpy(np.ascontiguousarray(send)),
                output_split_sizes=recv_counts.tolist(),
                input_split_sizes=send_counts.tolist(),
                group=self.process_group,
            )
        return recv.numpy()

    def group(self, ranks: tuple[int, ...], label: str) -> TorchCommunicator:
        """The communicator on the process group of ``ranks`` (global ranks), the first one
        made with those ranks; an error naming ``label``'s op when this rank is not one of them
        or no group has them."""
        rank = dist.get_rank()
        if rank not in ranks:
            raise MoeOpError(f"group_ranks {list(ranks)} do not include this rank ({rank})", op_type=label)
        group = process_group_of(ranks, label)
        return default_communicator(label) if group is dist.group.WORLD else _communicator_of(group)


def ranks_of(group) -> list[int]:
    """The global ranks of a process group, in its rank order."""
    return dist.get_process_group_ranks(group)


def process_group_of(ranks: tuple[int, ...], op: str):
    """The first process group made (on every rank, in one order) with exactly ``ranks``."""
    if ranks == tuple(range(dist.get_world_size())):
        return dist.group.WORLD
    for group in dist.distributed_c10d._world.pg_group_ranks:
        if tuple(ranks_of(group)) == ranks:
            return group
    raise MoeOpError(
        f"no torch.distributed process group has the ranks {list(ranks)}: make it with "
        "torch.distributed.new_group (on every rank) before running the op on it",
        op_type=op,
    )


_by_group: dict = {}  # process group -> its communicator (collectives numbered across calls)


def _communicator_of(group) -> TorchCommunicator:
    if group not in _by_group:
        _by_group[group] = TorchCommunicator(group)
    return _by_group[group]


_default: TorchCommunicator | None = None
#: group name -> its communicator: the names torch_npu's MC2 ops take (``group_ep``, ``group``)
_named: dict[str, TorchCommunicator] = {}
#: the attributes that name an op's group (SPEC-mc2 1.19 a)
GROUP_ATTRIBUTES = ("group_ep", "group")


def default_communicator(op: str) -> TorchCommunicator:
    """The communicator on the default group, one per group for the process (so collectives
    are numbered across op calls); ``op`` names the op in the error when there is no group."""
    global _default
    if not (dist.is_available() and dist.is_initialized()):
        raise MoeOpError("torch.distributed is not initialized: call torch.distributed.init_process_group", op_type=op)
    if _default is None or _default.world is not dist.group.WORLD:
        _default = TorchCommunicator()
    return _default


def register_group(name: str, group=None) -> None:
    """Run ops whose group attribute (``group_ep``, ``group``) is ``name`` on ``group`` (a
    ``torch.distributed`` process group; None = the default group). Real Ascend code gets
    the name from ``get_hccl_comm_name``, which has no CPU equivalent; an unregistered name
    means the default group. A group of fewer ranks than the world is carried by the ops as
    their ``group_ranks`` (:func:`group_ranks_of`), so an export runs on the same ranks."""
    _named[name] = TorchCommunicator(group)


def group_ranks_of(name: str) -> list[int] | None:
    """The ``group_ranks`` of the group registered under ``name``: its global ranks, or None
    for an unregistered name and for a group of the whole world."""
    communicator = _named.get(name)
    if communicator is None or communicator.process_group is None:
        return None
    ranks = ranks_of(communicator.process_group)
    return None if ranks == list(range(dist.get_world_size())) else ranks


def communicator_for(op: str, attrs: dict) -> TorchCommunicator:
    """The communicator an op call runs on: the default group's for an op with
    ``group_ranks`` (the kernel then takes its group's, :meth:`TorchCommunicator.group`), else
    the one registered under its group attribute's value (:func:`register_group`), else the
    default group's."""
    if attrs.get("group_ranks") is not None:
        return default_communicator(op)
    for attribute in GROUP_ATTRIBUTES:
        name = attrs.get(attribute)
        if name in _named:
            if not (dist.is_available() and dist.is_initialized()):
                raise MoeOpError(
                    "torch.distributed is not initialized: call torch.distributed.init_process_group", op_type=op
                )
            return _named[name]
    return default_communicator(op)
