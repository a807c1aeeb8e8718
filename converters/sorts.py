"""What a chunk-sort match finds and gives back: the counts, the sort, its restore.

After the token AllToAll the received rows are rank-major: block (r, e) holds ``counts[r, e]``
rows from rank r for local expert e (r < N, e < L). Exporters regroup them expert-major
(block (e, r)) before the experts and undo it before the return AllToAll. A match finds the
forward regrouping (:class:`ChunkSort`: which rows each expert input holds, as
:class:`Piece` s) and its inverse (:class:`Restore`). The rewrite is the same for all:

    permuted = MoeReRoutingV2(rows, counts, idx_type=1)    # rows [A, H] rank-major -> expert-major
    index    = permuted.permute_token_idx                  # [A]: source row -> destination row
    rank_major = Gather(expert_major_rows, index)          # the restore: row s <- row index[s]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import onnx_ir as ir

if TYPE_CHECKING:
    from .build import Builder
    from .facts import GraphFacts
    from .world import World


@dataclass
class Counts:
    """``counts [N, L]``: ``counts[r, e]`` = rows received from rank r for local expert e.

    One of: computed (``value``: ``[N, L]``, or ``flat``: any static shape of the N*L counts
    rank-major, e.g. ``[N*L]`` sizes or ``[1, N, L]``, reshaped); a constant (``constant``); or
    ``full([N, L], rows / (N*L))`` computed at run time from the received rows (``capacity``: a
    capacity layout; ``send_key`` tells which all-to-alls send alike, hence receive the same C).
    """

    ranks: int | None  # None: not static (a computed [?, L] counts tensor)
    experts: int
    value: ir.Value | None = None
    constant: np.ndarray | None = None
    flat: bool = False
    capacity: bool = False
    send_key: tuple = ()

    def key(self) -> tuple:
        """Equal keys = the same counts, so the same row order (sorts that may share one node)."""
        if self.value is not None:
            return ("value", id(self.value), self.ranks, self.experts)
        if self.capacity:
            return ("capacity", self.ranks, self.experts, self.send_key)
        assert self.constant is not None
        return ("constant", self.ranks, self.experts, self.constant.astype(np.int64).tobytes())

    @property
    def is_constant(self) -> bool:
        return self.constant is not None

    def describe(self) -> str:
        if self.value is not None:
            if self.flat:
                return f"computed: Reshape('{self.value.name}', [{self.ranks}, {self.experts}])"
            return f"computed: '{self.value.name}' [{self.ranks or 'N'}, {self.experts}]"
        if self.capacity:
            blocks = (self.ranks or 0) * self.experts
            return f"computed: full([{self.ranks}, {self.experts}], rows / {blocks}) from the received rows' shape"
        assert self.constant is not None
        values = np.unique(self.constant)
        if len(values) == 1:
            return f"constant full([{self.ranks}, {self.experts}], {int(values[0])})"
        return f"constant {self.constant.tolist()}"


@dataclass
class Piece:
    """A value the experts read: the expert-major rows of local experts ``[lo, hi)``, viewed with
    ``lead`` leading dims (``-1`` where it varies; None: rows ``[n, *row]`` as they are)."""

    value: ir.Value
    lo: int
    hi: int
    lead: list[int] | None


@dataclass
class Probe:
    """One evaluation the match was checked on: the counts, the shape of every piece, and how the
    free values of a cut get their value there (``feed(value)``; None if it cannot)."""

    counts: np.ndarray
    shapes: dict[int, tuple[int, ...]]
    feed: Callable[[ir.Value], np.ndarray | None]
    label: str = ""


@dataclass
class ChunkSort:
    """One forward chunk sort found after an AllToAll.

    ``outputs`` are the values the experts read (the pieces'); ``row_dims`` are the dims after
    dim 0 of the rows the rerouting takes (``()`` for 1-D rows such as probs; None if unknown);
    ``view_rows`` says the received tensor must first be reshaped to ``[-1, *row_dims]``.
    """

    rule: Rule
    all_to_all: ir.Node
    received: ir.Value
    counts: Counts
    nodes: list[ir.Node]
    outputs: list[ir.Value]
    row_dims: tuple[int | None, ...] | None
    view_rows: bool = False
    layout: dict = field(default_factory=dict)  # what the rule's replace needs beyond the above
    dtype: ir.DataType | None = None  # of the received rows (set by the pass)
    pieces: list[Piece] = field(default_factory=list)
    probes: list[Probe] = field(default_factory=list)
    mode: str = ""  # how it was probed: "counts", "shapes", "constant counts", "mirror world"

    @property
    def label(self) -> str:
        return f"{self.all_to_all.op_type} '{self.all_to_all.name}'"

    def describe_pieces(self) -> str:
        def experts(piece: Piece) -> str:
            return f"expert {piece.lo}" if piece.hi == piece.lo + 1 else f"experts {piece.lo}..{piece.hi - 1}"

        return ", ".join(f"'{p.value.name}' <- {experts(p)}" for p in self.pieces)


@dataclass
class Restore:
    """One inverse chunk sort: ``outputs[0]`` (rank-major) is rebuilt from expert-major rows."""

    finder: RestoreRule
    nodes: list[ir.Node]
    inputs: list[ir.Value]  # the expert-major values it reads, in local-expert order
    outputs: list[ir.Value]  # the rank-major values it gives
    layout: dict = field(default_factory=dict)

    def describe(self) -> str:
        return " + ".join(f"{n.op_type} '{n.name}'" for n in self.nodes)


class Rule(Protocol):
    """A forward match and its replacement."""

    name: str

    @property
    def restore(self) -> RestoreRule:
        """The rule that finds and replaces this sort's inverse."""
        ...

    def match(self, received: ir.Value, facts: GraphFacts, world: World) -> ChunkSort | None:
        """The chunk sort reading ``received``; None if there is none to look at; raises Skip
        (why not) or AmbiguousMatch."""
        ...

    def replace(self, sort: ChunkSort, rows: ir.Value, expert_counts: ir.Value, build: Builder) -> None:
        """Make ``sort.outputs`` read the permuted rows ``rows [A, *row_dims]`` instead
        (``expert_counts [L]``: rows per local expert, MoeReRoutingV2's ``expert_token_num``)."""
        ...


class RestoreRule(Protocol):
    """An inverse match and its replacement."""

    def find(self, sorts: list[ChunkSort], facts: GraphFacts, world: World) -> list[Restore]:
        """Every restore of the sorts of one group (between their pieces and the next all-to-all)."""
        ...

    def replace(self, restore: Restore, index: ir.Value, build: Builder) -> None:
        """Rebuild ``restore.outputs`` with ``Gather(expert-major rows, index)``."""
        ...
