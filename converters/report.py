"""What a conversion did, per all-to-all node: as text (``str``) and as JSON (``to_dict``)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

#: the statuses of an all-to-all node, in the order the text report lists them
STATUSES = ("converted", "folded", "already converted", "skipped")


@dataclass
class AllToAllReport:
    """One all-to-all node.

    status: ``converted`` (its chunk sort is now a MoeReRoutingV2), ``folded`` (its rows ride
    in another node's MoeReRoutingV2, e.g. probs as ``per_token_scales``), ``already
    converted``, or ``skipped`` (no chunk sort; ``reasons`` says why). ``warnings``: the chunk
    sort relies on constants the graph itself contradicts (batch-specific), whatever the status.
    """

    node: str
    op: str
    status: str = "skipped"
    rule: str | None = None
    counts: str | None = None  # how the [N, L] counts are obtained
    movement: str | None = None  # how the map was probed, and which experts each expert input holds
    rerouting: str | None = None  # the MoeReRoutingV2 node that now sorts its rows
    removed: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    folded: list[str] = field(default_factory=list)  # other rows carried by the same node
    restores: list[str] = field(default_factory=list)  # "old nodes -> new nodes"
    warnings: list[str] = field(default_factory=list)  # batch-specific
    reasons: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        head = f"{self.op} '{self.node}': {self.status}"
        if self.status == "converted":
            head += f" by {self.rule}, counts {self.counts}, MoeReRoutingV2 '{self.rerouting}'"
        lines = [head]
        if self.movement:
            lines.append(f"    map: {self.movement}")
        if self.folded:
            lines += [f"    folded: {f}" for f in self.folded]
        if self.restores:
            lines += [f"    restore: {r}" for r in self.restores]
        elif self.status == "converted":
            lines.append("    restore: none found (the original inverse stays; it still reads expert-major rows)")
        if self.removed or self.added:
            lines.append(f"    removed {len(self.removed)} node(s): {', '.join(self.removed) or '-'}")
            lines.append(f"    added {len(self.added)} node(s): {', '.join(self.added) or '-'}")
        lines += [f"    WARNING: {warning}" for warning in self.warnings]
        lines += [f"    {reason}" for reason in self.reasons]
        return lines


@dataclass
class ConversionReport:
    entries: list[AllToAllReport] = field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0

    @property
    def changed(self) -> bool:
        return any(e.status == "converted" for e in self.entries)

    def _with(self, *statuses: str) -> list[AllToAllReport]:
        return [e for e in self.entries if e.status in statuses]

    @property
    def matched(self) -> list[str]:
        """One line per converted chunk sort."""
        return [e.lines()[0] for e in self._with("converted")]

    @property
    def replaced(self) -> list[str]:
        """Names of the removed nodes."""
        return [name for e in self.entries for name in e.removed]

    @property
    def added(self) -> list[str]:
        return [name for e in self.entries for name in e.added]

    @property
    def skipped(self) -> list[str]:
        """One line per all-to-all not converted, with why."""
        return [
            f"{e.op} '{e.node}': {e.status}: {'; '.join(e.reasons)}" for e in self._with("already converted", "skipped")
        ]

    @property
    def batch_specific(self) -> list[AllToAllReport]:
        """The all-to-all nodes with a batch-specific warning."""
        return [e for e in self.entries if e.warnings]

    def __str__(self) -> str:
        counts = {s: len(self._with(s)) for s in STATUSES}
        lines = [
            f"matched {counts['converted']} chunk sort(s) at {len(self.entries)} all-to-all node(s): "
            + ", ".join(f"{n} {s}" for s, n in counts.items())
            + f"; {len(self.batch_specific)} batch-specific; nodes {self.nodes_before} -> {self.nodes_after}"
        ]
        for status in STATUSES:
            for entry in self._with(status):
                lines += entry.lines()
        if self.batch_specific:
            lines.append(
                "WARNING: batch-specific graph: "
                + ", ".join(f"'{e.node}'" for e in self.batch_specific)
                + " rely on constants the graph contradicts on other batches; the model only holds for the batch "
                "it was traced with (re-export with data-dependent sizes; --strict refuses)"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "changed": self.changed,
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "batch_specific": [e.node for e in self.batch_specific],
            "all_to_all": [asdict(e) for e in self.entries],
        }

    def save_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")
