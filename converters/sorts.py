"""What every chunk-sort rule finds and gives back: the counts, the sort, its restore.

After the token AllToAll the received rows are rank-major: block (r, e) holds ``counts[r, e]``
rows from rank r for local expert e (r < N, e < L). Exporters regroup them expert-major
(block (e, r)) before the experts and undo it before the return AllToAll. A rule finds one
exported form of the forward regrouping (:class:`ChunkSort`) and of its inverse
(:class:`Restore`), and writes its replacement beside its pattern. The rewrite is the same for all:

    permuted = MoeReRoutingV2(rows, counts, idx_type=1)    # rows [A, H] rank-major -> expert-major
    index    = permuted.permute_token_idx                  # [A]: source row -> destination row
    rank_major = Gather(expert_major_rows, index)          # the restore: row s <- row index[s]
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import onnx_ir as ir

from .graph_utils import consumers, is_all_to_all

if TYPE_CHECKING:
    from .build import Builder
    from .facts import GraphFacts


@dataclass
class Counts:
    """``counts [N, L]``: ``counts[r, e]`` = rows received from rank r for local expert e.

    Either computed (``value``: ``[N, L]``, or the flattened ``[N*L]`` rank-major sizes when
    ``flat``) or a constant (``constant``: capacity layouts, ``full([N, L], C)``).
    """

    ranks: int | None  # None: not static (only the gather-index rule allows it)
    experts: int
    value: ir.Value | None = None
    constant: np.ndarray | None = None
    flat: bool = False

    def key(self) -> tuple:
        """Equal keys = the same counts, so the same row order (sorts that may share one node)."""
        if self.value is not None:
            return ("value", id(self.value), self.ranks, self.experts)
        assert self.constant is not None
        return ("constant", self.ranks, self.experts, self.constant.astype(np.int64).tobytes())

    def describe(self) -> str:
        if self.value is not None:
            if self.flat:
                return f"computed: Reshape('{self.value.name}', [{self.ranks}, {self.experts}])"
            return f"computed: '{self.value.name}' [{self.ranks or 'N'}, {self.experts}]"
        assert self.constant is not None
        values = np.unique(self.constant)
        if len(values) == 1:
            return f"constant full([{self.ranks}, {self.experts}], {int(values[0])})"
        return f"constant {self.constant.tolist()}"


@dataclass
class ChunkSort:
    """One forward chunk sort found after an AllToAll.

    ``outputs`` are the pattern's expert-major results (the rule's ``replace`` rebuilds them
    from the permuted rows). ``row_dims`` are the dims after dim 0 of the rows the rerouting
    takes (``()`` for 1-D rows such as probs; None if unknown); ``view_rows`` says the received
    tensor must first be reshaped to ``[-1, *row_dims]``.
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

    @property
    def label(self) -> str:
        return f"{self.all_to_all.op_type} '{self.all_to_all.name}'"


@dataclass
class Restore:
    """One inverse chunk sort: ``outputs[0]`` (rank-major) is rebuilt from expert-major rows."""

    finder: RestoreRule
    nodes: list[ir.Node]
    inputs: list[ir.Value]  # the expert-major values it reads
    outputs: list[ir.Value]  # the rank-major values it gives
    layout: dict = field(default_factory=dict)

    def describe(self) -> str:
        return " + ".join(f"{n.op_type} '{n.name}'" for n in self.nodes)


class Rule(Protocol):
    """A forward pattern and its replacement."""

    name: str

    @property
    def restore(self) -> RestoreRule:
        """The rule that finds and replaces this sort's inverse."""
        ...

    def match(self, received: ir.Value, facts: GraphFacts) -> ChunkSort | None:
        """The chunk sort reading ``received``; None if this rule's pattern does not start there;
        raises Skip (why not) or AmbiguousMatch."""
        ...

    def replace(self, sort: ChunkSort, rows: ir.Value, build: Builder) -> None:
        """Make ``sort.outputs`` read the permuted rows ``rows [A, *row_dims]`` instead."""
        ...


class RestoreRule(Protocol):
    """An inverse pattern and its replacement."""

    def find(self, sort: ChunkSort, facts: GraphFacts) -> list[Restore]:
        """Every restore of ``sort`` (between its outputs and the next all-to-all)."""
        ...

    def replace(self, restore: Restore, index: ir.Value, build: Builder) -> None:
        """Rebuild ``restore.outputs`` with ``Gather(expert-major rows, index)``."""
        ...


def expert_major_order(ranks: int, experts: int) -> list[int]:
    """Rank-major block ids (r*L + e) listed in expert-major order (e, then r)."""
    return [r * experts + e for e in range(experts) for r in range(ranks)]


def rank_major_order(ranks: int, experts: int) -> list[int]:
    """Expert-major block ids (e*N + r) listed in rank-major order (r, then e)."""
    return [e * ranks + r for r in range(ranks) for e in range(experts)]


def factorisations(blocks: int) -> list[tuple[int, int]]:
    """Every (N, L) with N * L == blocks."""
    return [(blocks // experts, experts) for experts in range(1, blocks + 1) if blocks % experts == 0]


def downstream(values: Iterable[ir.Value]) -> list[ir.Node]:
    """Nodes computed from ``values``, up to (not through) the next all-to-all: where the experts
    and the restore of one MoE layer lie. In graph order."""
    seen: dict[int, ir.Node] = {}
    pending = list(values)
    while pending:
        for node in consumers(pending.pop()):
            if id(node) in seen or is_all_to_all(node):
                continue
            seen[id(node)] = node
            pending.extend(node.outputs)
    graph = next((n.graph for n in seen.values() if n.graph is not None), None)
    return [n for n in graph if id(n) in seen] if graph is not None else list(seen.values())
