"""The op library's ``Communicator`` on ``torch.distributed`` (the default group; gloo on CPU).

With it the AllToAll and AllGather kernels run eagerly between torch processes exactly as
they run between onnxruntime ranks: each rank first shares its verdict on its own input, so
a bad input on one rank is the same ``MoeOpError`` on every rank.
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
        self.group = group
        self.world = dist.group.WORLD  # (a re-initialised default group is another object)
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.collectives = 0  # numbered across calls, for CollectiveMismatch's message

    def allgather(self, value: object, label: str) -> list:
        """Every rank's ``value``; :class:`~moe_onnx.custom_ops.all_to_all.CollectiveMismatch`
        on every rank if their ``label`` (what the collective is) differ."""
        self.collectives += 1
        gathered: list = [None] * self.size
        dist.all_gather_object(gathered, (label, value), group=self.group)
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
                group=self.group,
            )
        return recv.numpy()


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
    means the default group."""
    _named[name] = TorchCommunicator(group)


def communicator_for(op: str, attrs: dict) -> TorchCommunicator:
    """The communicator an op call runs on: the one registered under its group attribute's
    value (:func:`register_group`), else the default group's."""
    for attribute in GROUP_ATTRIBUTES:
        name = attrs.get(attribute)
        if name in _named:
            if not (dist.is_available() and dist.is_initialized()):
                raise MoeOpError(
                    "torch.distributed is not initialized: call torch.distributed.init_process_group", op_type=op
                )
            return _named[name]
    return default_communicator(op)
