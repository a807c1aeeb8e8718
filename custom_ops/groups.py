"""Collectives on a group smaller than the world: the ``group_ranks`` attribute.

A collective op (AllToAll, AllGather, the MC2 ops) with ``group_ranks = [g_0, g_1, ...]``
(world ranks, strictly increasing) runs on those ranks only, as their own communicator:
rank ``g_i`` is rank ``i`` of the group, ``N`` = the group's size. Without the attribute the
op runs on the whole world (every model written before it is unchanged).

The groups are agreed the way ``MPI_Comm_split`` and ``torch.distributed.new_group`` agree
them: collectively, over the world. Each rank of the world says which group its op runs on
(:meth:`GroupCommunicator.group`), every rank checks every rank's choice
(:func:`check_groups`), and a mismatch (rank 0 on ``[0, 1]``, rank 1 on ``[1, 2]``) is the same
:class:`MoeOpError` on every rank instead of ranks waiting for peers that sit in another
group. So every rank of the world runs the group's collective at the same point of its model,
as the per-rank exports of one SPMD program do; the group's own exchanges then run on its
sub-communicator (threads: a world of the group's threads; MPI: ``Comm.Split``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from .errors import BAD_CONSTRAINT, NO_COMMUNICATOR, MoeOpError

if TYPE_CHECKING:
    from .all_to_all import Communicator

#: the attribute's name; an op declaring it (``opdef.GROUP_RANKS_ATTR``) runs on the group it
#: names: ``OpDef.signature`` checks it (:func:`ranks_problem`), ``OpDef.run_inferred`` hands the
#: kernel the group's communicator (:func:`on_group`) and never the attribute itself
GROUP_RANKS = "group_ranks"


def ranks_problem(ranks: Sequence[int]) -> str | None:
    """The static rule on one node's ``group_ranks``: non-empty, >= 0, strictly increasing."""
    if not ranks:
        return "group_ranks must name at least one rank (leave it out for the whole world)"
    if ranks[0] < 0:
        return f"group_ranks must be >= 0, got {list(ranks)}"
    if any(b <= a for a, b in zip(ranks, ranks[1:])):
        return f"group_ranks must be strictly increasing (a rank once, in rank order), got {list(ranks)}"
    return None


def _named(group: Sequence[int] | None) -> str:
    return "the whole world" if group is None else str(list(group))


def check_groups(declared: Sequence[Sequence[int] | None], world: int) -> list[tuple[int, ...]]:
    """Every rank's group (``declared[r]``: rank r's ``group_ranks``, None = the whole world)
    must hold that rank, name ranks of the world only, and be the group each of its members
    declares: the groups then split the world. Returns the split (each group once, ordered by
    its first rank); raises the same :class:`MoeOpError` on every rank otherwise."""
    full = tuple(range(world))
    groups = [full if group is None else tuple(group) for group in declared]
    for rank, group in enumerate(groups):
        outside = [r for r in group if not 0 <= r < world]
        if outside:
            raise MoeOpError(
                f"rank {rank}'s group_ranks {list(group)} name rank {outside[0]}, but the world has {world} ranks",
                BAD_CONSTRAINT,
            )
        if rank not in group:
            raise MoeOpError(f"rank {rank}'s group_ranks {list(group)} do not include rank {rank}", BAD_CONSTRAINT)
    for rank, group in enumerate(groups):
        for member in group:
            if groups[member] != group:
                raise MoeOpError(
                    f"the ranks disagree on their groups: rank {rank} runs on {_named(declared[rank])}, "
                    f"but rank {member} (a member of it) on {_named(declared[member])}",
                    BAD_CONSTRAINT,
                )
    return sorted(set(groups))


class GroupCommunicator(Protocol):
    """A :class:`~.all_to_all.Communicator` that can make the communicator of a group."""

    def group(self, ranks: tuple[int, ...], label: str) -> Communicator:
        """The communicator of ``ranks`` (world ranks, this rank among them); ``label`` names
        the collective (in a mismatch's message)."""


def on_group(communicator: Communicator | None, ranks: Sequence[int] | None, label: str) -> Communicator | None:
    """The communicator an op with ``group_ranks = ranks`` runs on: ``communicator`` itself
    when ``ranks`` is None, else its group's."""
    if ranks is None:
        return communicator
    if communicator is None:
        raise MoeOpError(NO_COMMUNICATOR)
    make = getattr(communicator, "group", None)
    if make is None:
        raise MoeOpError(f"this rank's communicator ({type(communicator).__name__}) cannot run a group of ranks")
    return make(tuple(ranks), label)


def agree_on_group(communicator: Communicator, ranks: tuple[int, ...], label: str) -> list[tuple[int, ...]]:
    """The world's split into groups, agreed in one ``allgather`` over ``communicator`` (the
    world) where each rank gives its ``ranks``; the same error on every rank on a mismatch."""
    declared = communicator.allgather(ranks, f"{label} on a group")
    return check_groups(declared, communicator.size)
