"""The recognised chunk-sort patterns, each beside its replacement and its restore.

* ``split_concat`` (:class:`SplitConcat`): ``Split(rows, sizes)`` + ``Concat`` expert-major;
  restore ``Split`` + ``Concat`` rank-major with sizes ``counts.T``; counts computed (probed);
* ``gather_index`` (:class:`GatherIndex`): ``Gather(rows, index(counts))``; restore
  ``ScatterND(zeros, index[:, None], y)``; counts computed (probed);
* ``drop_pad`` (:class:`ReshapeTranspose`): ``Reshape [N, L, C, H]`` + ``Transpose(1, 0, ...)``
  (+ back to rows); restore the transpose back (+ rows); counts ``full([N, L], C)``;
* ``gshard`` (:class:`ExpertSlices`): ``Reshape [N, L, C, M]`` + Split / Slice / Gather on axis 1;
  restore ``Concat(axis=1)`` of the experts' outputs; counts ``full([N, L], C)``.

Shared types (:class:`~.sorts.ChunkSort`, :class:`~.sorts.Restore`, :class:`~.sorts.Counts`) are
in :mod:`.sorts`; the dropless rules in :mod:`.dropless`, the capacity rules in :mod:`.capacity`.
"""

from __future__ import annotations

from .capacity import ExpertConcatRestore, ExpertSlices, ReshapeTranspose, TransposeRestore
from .dropless import GatherIndex, ScatterRestore, SplitConcat, SplitConcatRestore
from .reroute import RULES
from .sorts import ChunkSort, Counts, Restore, expert_major_order, rank_major_order

__all__ = [
    "RULES",
    "ChunkSort",
    "Counts",
    "ExpertConcatRestore",
    "ExpertSlices",
    "GatherIndex",
    "ReshapeTranspose",
    "Restore",
    "ScatterRestore",
    "SplitConcat",
    "SplitConcatRestore",
    "TransposeRestore",
    "expert_major_order",
    "rank_major_order",
]
