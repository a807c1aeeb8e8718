"""The pass: one MoeReRoutingV2 in place of each post-AlltoAll chunk sort."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from moe_onnx.custom_ops import DOMAIN, OPSET_VERSION
from moe_onnx.custom_ops.moe_re_routing_v2 import MOE_RE_ROUTING_V2

from .chunk_sort import RULES, Match, Skip
from .graph_utils import DEFAULT_ALL_TO_ALL, is_all_to_all, op_node, output, remove_dead


@dataclass
class ConversionReport:
    matched: list[str] = field(default_factory=list)  # one line per rewritten chunk sort
    replaced: list[str] = field(default_factory=list)  # names of removed nodes
    added: list[str] = field(default_factory=list)  # names of inserted nodes
    skipped: list[str] = field(default_factory=list)  # candidate AllToAll: why not

    @property
    def changed(self) -> bool:
        return bool(self.matched)

    def __str__(self) -> str:
        lines = [f"matched {len(self.matched)} chunk sort(s)"]
        lines += [f"  {m}" for m in self.matched]
        lines.append(f"replaced {len(self.replaced)} node(s): {', '.join(self.replaced) or '-'}")
        lines.append(f"added {len(self.added)} node(s): {', '.join(self.added) or '-'}")
        lines.append(f"skipped {len(self.skipped)} candidate(s)")
        lines += [f"  {s}" for s in self.skipped]
        return "\n".join(lines)


class AmbiguousMatch(ValueError):
    """Raised before anything is changed when a candidate cannot be rewritten safely."""


class InsertRerouting(ir.passes.InPlacePass):
    """Replace the chunk sort after each AllToAll by MoeReRoutingV2, and its restore by a Gather.

    All candidates are matched before any is rewritten: an ambiguous one raises
    :class:`AmbiguousMatch` (naming the nodes) and leaves the model as it was.
    """

    def __init__(self, all_to_all_ops=DEFAULT_ALL_TO_ALL, rules=RULES):
        super().__init__()
        self.all_to_all_ops = tuple(all_to_all_ops)
        self.rules = rules
        self.report = ConversionReport()

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.report = ConversionReport()
        matches = [
            m
            for node in list(model.graph)
            if is_all_to_all(node, self.all_to_all_ops)
            for m in [self._match(node)]
            if m is not None
        ]
        for match in matches:
            self._rewrite(model.graph, match)
        if matches:
            model.opset_imports.setdefault(DOMAIN, OPSET_VERSION)
        return ir.passes.PassResult(model, modified=bool(matches))

    def _match(self, all_to_all: ir.Node) -> Match | None:
        received = all_to_all.outputs[0]
        label = f"{all_to_all.op_type} '{all_to_all.name}'"
        if any(
            u.node.op_type in ("MoeReRoutingV2", "MoeReRouting") and u.node.domain == DOMAIN and u.idx == 0
            for u in received.uses()
        ):
            self.report.skipped.append(f"{label}: already followed by MoeReRoutingV2")
            return None
        found = []
        for rule in self.rules:
            try:
                match = rule.match(received)
            except Skip as why:
                if str(why).startswith("ambiguous"):
                    raise AmbiguousMatch(f"{label}: {why}") from None
                self.report.skipped.append(f"{label}: {rule.name}: {why}")
                continue
            if match is not None:
                found.append(match)
        if len(found) > 1:
            raise AmbiguousMatch(
                f"{label}: its rows match {len(found)} chunk sorts ({[m.nodes[-1].name for m in found]})"
            )
        if not found:
            if not any(s.startswith(label) for s in self.report.skipped):
                self.report.skipped.append(f"{label}: no chunk sort by local expert follows it")
            return None
        return found[0]

    def _rewrite(self, graph: ir.Graph, match: Match) -> None:
        anchor = match.nodes[-1]
        name = f"{anchor.name or 'chunk_sort'}/rerouting"
        counts = match.counts
        if isinstance(counts, np.ndarray):
            counts = _initializer(graph, f"{name}/counts", counts)
        rerouting = op_node(MOE_RE_ROUTING_V2, [match.received, counts], {"idx_type": 1}, name)
        new_nodes = [rerouting]
        expert_major = output(rerouting, MOE_RE_ROUTING_V2, "permute_tokens")
        if match.reshape_to is not None:
            shape = _initializer(graph, f"{name}/shape", np.array(match.reshape_to, np.int64))
            new_nodes.append(ir.node("Reshape", [expert_major, shape], name=f"{name}/reshape"))
            expert_major = new_nodes[-1].outputs[0]
        graph.insert_before(anchor, new_nodes)
        _take_over(match.expert_major, expert_major)
        added = [n.name or n.op_type for n in new_nodes]  # all named above
        old_nodes = list(match.nodes)
        line = f"{match.rule}: '{match.received.name}' -> MoeReRoutingV2 '{name}' (counts '{counts.name}')"
        if match.restore is not None:
            restore = match.restore
            prefix = restore.nodes[-1].name or "restore"
            restore_nodes, rows = [], restore.expert_out
            if restore.flatten:  # [L, N, C, H] -> [L*N*C, H]
                restore_nodes.append(ir.node("Flatten", [rows], {"axis": 3}, name=f"{prefix}/flatten"))
                rows = restore_nodes[-1].outputs[0]
            scatter_index = output(rerouting, MOE_RE_ROUTING_V2, "permute_token_idx")
            restore_nodes.append(ir.node("Gather", [rows, scatter_index], {"axis": 0}, name=f"{prefix}/gather"))
            graph.insert_before(restore.nodes[-1], restore_nodes)
            _take_over(restore.rank_major, restore_nodes[-1].outputs[0])
            added += [n.name or n.op_type for n in restore_nodes]
            old_nodes += restore.nodes
            line += f"; restore -> Gather '{restore_nodes[-1].name}'"
        else:
            line += "; no restore found"
        self.report.matched.append(line)
        self.report.added += added
        self.report.replaced += remove_dead(graph, reversed(old_nodes))


def _initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    value = ir.val(name, ir.DataType.INT64, list(array.shape), const_value=ir.tensor(array, name=name))
    graph.register_initializer(value)
    return value


def _take_over(old: ir.Value, new: ir.Value) -> None:
    """Every use of ``old`` (graph outputs included) now reads ``new``, under ``old``'s name."""
    name = old.name
    new.type, new.shape = old.type or new.type, old.shape or new.shape
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    old.name = f"{name}/replaced"
    new.name = name
