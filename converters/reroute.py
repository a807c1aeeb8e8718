"""The pass: one MoeReRoutingV2 in place of each post-AlltoAll chunk sort, one Gather per restore.

Steps, all on a clone of the model (the model given is replaced only once everything succeeded):

1. match: every rule of :data:`RULES` (the movement map, :mod:`.movement_map`) at every
   all-to-all's received rows; a rule either finds its chunk sort, says why not
   (:class:`Skip`), or finds it ambiguous (:class:`AmbiguousMatch`); an ambiguity, or any
   other exception while examining one all-to-all, becomes that all-to-all's skip reason;
2. group: sorts by the same counts share one node: the tokens ``[A, H]`` carry 1-D probs /
   scales ``[A]`` as ``per_token_scales`` (float32; other float types cast there and back,
   exactly) and ``[A, 1]`` float32 weights as ``expert_topk_weight``;
3. restores: every restore of a group's sorts (downstream of them, before the next all-to-all);
   a group with two restores (or sharing one with another group) is skipped, with why;
4. batch check: a sort whose counts are constants is checked against what the graph computes
   (:mod:`.batch_check`); a disagreement is a warning on its all-to-all, whether the rewrite
   is made or not (``strict`` refuses);
5. rewrite each group, remove the nodes made dead (only those), keep the node order topological.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import onnx_ir as ir

from moe_onnx.custom_ops import DOMAIN, OPSET_VERSION
from moe_onnx.custom_ops.moe_re_routing_v2 import MOE_RE_ROUTING_V2

from . import batch_check
from .build import Builder
from .errors import AmbiguousMatch, BatchSpecificGraph, ConversionError, Skip
from .facts import GraphFacts
from .graph_utils import DEFAULT_ALL_TO_ALL, is_all_to_all, is_standard, output, remove_dead, upstream
from .movement_map import MovementMap
from .report import AllToAllReport, ConversionReport
from .sorts import ChunkSort, Restore, Rule
from .world import World

RULES: tuple[Rule, ...] = (MovementMap(),)

_SCALE_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
#: ops that only re-view or re-type rows: a MoeReRoutingV2 behind them still reads the received rows
_VIEWS = ("Reshape", "Cast", "Flatten", "Squeeze", "Unsqueeze", "Identity")


@dataclass
class Group:
    """Sorts by the same counts, rewritten as one MoeReRoutingV2."""

    tokens: ChunkSort
    scales: ChunkSort | None = None  # [A] probs / scales -> per_token_scales
    weight: ChunkSort | None = None  # [A, 1] float32 -> expert_topk_weight
    restores: list[Restore] = field(default_factory=list)

    @property
    def sorts(self) -> list[ChunkSort]:
        return [s for s in (self.tokens, self.scales, self.weight) if s is not None]

    @property
    def label(self) -> str:
        return " + ".join(s.label for s in self.sorts)


class InsertRerouting(ir.passes.InPlacePass):
    """Replace the chunk sort after each AllToAll by MoeReRoutingV2, and its restore by a Gather.

    An all-to-all whose chunk sort is ambiguous (two rules, two possible L, two restores, probs
    that two tokens sorts could carry) or cannot be examined (a form the probes cannot evaluate)
    is skipped with the reason in its report entry; the others are converted. A failure while
    rewriting raises :class:`ConversionError` naming the nodes (:class:`BatchSpecificGraph` when
    ``strict``), and the model is left exactly as it was. ``report`` says what was done at every
    all-to-all.
    """

    def __init__(self, all_to_all_ops=DEFAULT_ALL_TO_ALL, rules: tuple[Rule, ...] = RULES, strict: bool = False):
        super().__init__()
        self.all_to_all_ops = tuple(all_to_all_ops)
        self.rules = rules
        self.strict = strict
        self.report = ConversionReport()

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        work = model.clone()  # tensors shared, nodes and values new: the model stays as it is until the end
        graph = work.graph
        report = ConversionReport(nodes_before=len(graph), nodes_after=len(graph))
        self.report = report
        try:
            groups = self._plan(work, report)
        except ConversionError:
            raise
        except Exception as error:
            raise ConversionError(f"matching failed, nothing was changed: {type(error).__name__}: {error}") from error
        for group, entry in groups:
            try:
                self._rewrite(graph, group, entry)
            except ConversionError:
                raise
            except Exception as error:
                nodes = [n.name for s in group.sorts for n in s.nodes]
                nodes += [n.name for r in group.restores for n in r.nodes]
                raise ConversionError(
                    f"rewriting the chunk sort after {group.label} (nodes {nodes}) failed, nothing was changed: "
                    f"{type(error).__name__}: {error}"
                ) from error
        if not groups:
            return ir.passes.PassResult(model, modified=False)
        if not _topologically_sorted(graph):
            graph.sort()  # a folded probs all-to-all may come after the tokens' chunk sort
        graph.opset_imports.setdefault(DOMAIN, OPSET_VERSION)
        report.nodes_after = len(graph)
        model.graph = graph
        return ir.passes.PassResult(model, modified=True)

    # ------------------------------------------------------------------ matching
    def _plan(self, model: ir.Model, report: ConversionReport) -> list[tuple[Group, AllToAllReport]]:
        """Every group to rewrite, with its restores; changes nothing."""
        facts = GraphFacts(model)
        world = World(model)
        sorts, unmatched, all_to_alls = [], [], []
        for node in list(model.graph):
            if is_all_to_all(node, self.all_to_all_ops):
                entry, sort = self._match(node, facts, world)
                report.entries.append(entry)
                all_to_alls.append((entry, node))
                if sort is not None:
                    sorts.append((entry, sort))
                else:
                    unmatched.append((entry, node))
        groups = self._find_restores(self._group(sorts), {id(s): e for e, s in sorts}, facts, world)
        for entry, sort in sorts:
            try:
                warnings, notes = batch_check.check(sort, world)
            except Exception as error:  # a form the check cannot evaluate: say it was not made
                warnings, notes = [], [f"batch check not made: {_error_text(error)}"]
            entry.warnings += warnings
            entry.reasons += notes
        for entry, node in all_to_alls:  # converted or not: constants a trace left on its counts / order
            try:
                traced = batch_check.traced_constants(node, facts)
            except Exception as error:
                entry.reasons.append(f"check of its constants not made: {_error_text(error)}")
                continue
            entry.warnings += [w for w in traced if w not in entry.warnings]
        if self.strict and report.batch_specific:
            details = "; ".join(w for e in report.batch_specific for w in e.warnings)
            raise BatchSpecificGraph(f"strict: the graph only holds for the batch it was traced with: {details}")
        restored = {id(v): r for group, _ in groups for r in group.restores for v in r.outputs}
        for entry, node in unmatched:
            data = node.inputs[0] if node.inputs else None
            back = [restored[i] for i in _upstream(data) if i in restored] if data is not None else []
            if entry.status == "skipped" and back:
                entry.reasons.insert(0, f"the return all-to-all: it sends the rows restored by {back[0].describe()}")
            elif entry.status == "skipped" and (counted := _counts_of(node, sorts)):
                entry.reasons.insert(0, f"the counts all-to-all: it exchanges the counts of {counted}")
        return groups

    def _match(self, all_to_all: ir.Node, facts: GraphFacts, world: World) -> tuple[AllToAllReport, ChunkSort | None]:
        received = all_to_all.outputs[0]
        entry = AllToAllReport(all_to_all.name or "", f"{all_to_all.domain or 'ai.onnx'}::{all_to_all.op_type}")
        label = f"{all_to_all.op_type} '{all_to_all.name}'"
        if _rerouted(received):
            entry.status = "already converted"
            entry.reasons.append("its rows already go to a MoeReRoutingV2")
            return entry, None
        found = []
        for rule in self.rules:
            try:
                sort = rule.match(received, facts, world)
            except Skip as why:
                entry.reasons.append(f"{rule.name}: {why}")
                continue
            except AmbiguousMatch as why:
                entry.reasons.append(f"{rule.name}: ambiguous: {why}; left as it is")
                continue
            except Exception as error:  # a form the rule cannot evaluate: skip this all-to-all, say why
                text = _error_text(error)
                entry.reasons.append(f"{rule.name}: could not evaluate its region ({text}); left as it is")
                continue
            if sort is not None:
                sort.dtype = facts.dtype(received)
                found.append(sort)
        if len(found) > 1:
            entry.reasons.append(
                f"ambiguous: {label}: its rows match {len(found)} chunk sorts: "
                + ", ".join(f"{s.rule.name} ({[n.name for n in s.nodes]})" for s in found)
                + "; left as it is"
            )
            return entry, None
        if found:
            return entry, found[0]
        if not entry.reasons:
            entry.reasons.append("no chunk sort by local expert follows it")
        entry.reasons = _merged(entry.reasons, self.rules)
        return entry, None

    @staticmethod
    def _group(sorts: list[tuple[AllToAllReport, ChunkSort]]) -> list[tuple[Group, AllToAllReport]]:
        """One group per tokens sort; probs / scales / weights by the same counts join it."""
        by_counts: dict[tuple, list[tuple[AllToAllReport, ChunkSort]]] = defaultdict(list)
        for entry, sort in sorts:
            by_counts[sort.counts.key()].append((entry, sort))
        groups: list[tuple[Group, AllToAllReport]] = []
        for members in by_counts.values():
            roles = {id(s): _role(s) for _, s in members}
            if not any(roles[id(s)] == "tokens" for _, s in members):  # lone [A, 1] rows are tokens too
                roles.update({id(s): "tokens" for _, s in members if roles[id(s)] == "weight"})
            tokens = [(Group(s), e) for e, s in members if roles[id(s)] == "tokens"]
            groups += tokens
            for entry, sort in members:
                role = roles[id(sort)]
                if role == "tokens":
                    continue
                if role == "other":
                    entry.reasons.append(
                        f"{sort.rule.name}: found a chunk sort of {_rows_text(sort)} rows; MoeReRoutingV2 takes "
                        "[A, H] tokens with [A] float scales or [A, 1] float32 weights: not converted"
                    )
                    continue
                if not tokens:
                    entry.reasons.append(
                        f"{sort.rule.name}: found a chunk sort of {_rows_text(sort)} rows, but no tokens "
                        "[A, H] are sorted by the same counts to carry them in one MoeReRoutingV2: not converted"
                    )
                    continue
                hosts = [g for g, _ in tokens if _independent(g.tokens, sort)]
                if len(hosts) != 1 or getattr(hosts[0], role) is not None:
                    names = [g.tokens.label for g in hosts]
                    entry.reasons.append(
                        f"{sort.rule.name}: ambiguous: {sort.label}: its {_rows_text(sort)} rows are sorted by the "
                        f"same counts as {len(hosts)} tokens chunk sorts that can carry them ({names})"
                        + (f", whose {role} slot is taken" if len(hosts) == 1 else "")
                        + ": not converted"
                    )
                    continue
                setattr(hosts[0], role, sort)
                entry.status, entry.rule = "folded", sort.rule.name
        return groups

    @staticmethod
    def _find_restores(
        groups: list[tuple[Group, AllToAllReport]], entry_of: dict[int, AllToAllReport], facts: GraphFacts, world: World
    ) -> list[tuple[Group, AllToAllReport]]:
        """Each group's restore; a group whose restore is ambiguous (two restores, a restore of two
        groups) or cannot be looked for is left out, the reason on its all-to-alls."""
        claimed: dict[int, Group] = {}
        refused: dict[int, str] = {}
        for group, _ in groups:
            try:
                found: dict[tuple, Restore] = {}
                for restore in group.tokens.rule.restore.find(group.sorts, facts, world):
                    found.setdefault(tuple(id(n) for n in restore.nodes), restore)
            except Exception as error:  # a form the restore rule cannot evaluate
                refused[id(group)] = f"could not look for its restore ({_error_text(error)})"
                continue
            restores = list(found.values())
            if len(restores) > 1:
                refused[id(group)] = (
                    f"ambiguous: {group.label}: {len(restores)} restores of the same chunk sort: "
                    + "; ".join(r.describe() for r in restores)
                )
                continue
            for restore in restores:
                for node in restore.nodes:
                    other = claimed.setdefault(id(node), group)
                    if other is not group:
                        why = f"ambiguous: {restore.describe()} restores both {other.label} and {group.label}"
                        refused[id(group)] = refused[id(other)] = why
            group.restores = restores
        kept = []
        for group, entry in groups:
            if id(group) not in refused:
                kept.append((group, entry))
                continue
            for sort in group.sorts:
                skipped = entry_of.get(id(sort), entry)
                skipped.status, skipped.rule = "skipped", None
                skipped.reasons.append(f"{sort.rule.name}: {refused[id(group)]}; not converted")
        return kept

    # ------------------------------------------------------------------ rewriting
    def _rewrite(self, graph: ir.Graph, group: Group, entry: AllToAllReport) -> None:
        position = {id(n): i for i, n in enumerate(graph)}
        tokens = group.tokens
        movement = f"probed on {tokens.mode}: {tokens.describe_pieces()}"  # before the pieces are renamed
        build = Builder(graph, tokens.all_to_all.name or "all_to_all")
        rows = _rows(tokens, build)
        inputs: list[ir.Value | None] = [rows, _counts(tokens, rows, build), None, None]
        scales_cast = None
        if group.scales is not None:
            scales = _rows(group.scales, build)
            dtype = group.scales.dtype
            if dtype is not None and dtype != ir.DataType.FLOAT:
                scales_cast = dtype
                scales = build.node("Cast", [scales], {"to": ir.DataType.FLOAT}, what="scales_float").outputs[0]
            inputs[2] = scales
        if group.weight is not None:
            inputs[3] = _rows(group.weight, build)
        while inputs[-1] is None:  # absent optional inputs at the end are left out
            inputs.pop()
        wanted = ["permute_topk_weight"] if group.weight is not None else []
        rerouting = build.op(MOE_RE_ROUTING_V2, inputs, {"idx_type": 1}, what="rerouting", optional_outputs=wanted)
        expert_counts = output(rerouting, MOE_RE_ROUTING_V2, "expert_token_num")
        tokens.rule.replace(tokens, output(rerouting, MOE_RE_ROUTING_V2, "permute_tokens"), expert_counts, build)
        if group.scales is not None:
            permuted = output(rerouting, MOE_RE_ROUTING_V2, "permute_per_token_scales")
            if scales_cast is not None:
                permuted = build.node("Cast", [permuted], {"to": scales_cast}, what="scales_back").outputs[0]
            group.scales.rule.replace(group.scales, permuted, expert_counts, build)
        if group.weight is not None:
            permuted = output(rerouting, MOE_RE_ROUTING_V2, "permute_topk_weight")
            group.weight.rule.replace(group.weight, permuted, expert_counts, build)
        pattern = [n for s in group.sorts for n in s.nodes]
        build.insert_before(min(pattern, key=lambda n: position[id(n)]))
        index = output(rerouting, MOE_RE_ROUTING_V2, "permute_token_idx")
        restore_lines = []
        for restore in group.restores:
            restore_build = Builder(graph, restore.nodes[-1].name or "restore")
            restore.finder.replace(restore, index, restore_build)
            restore_build.insert_before(min(restore.nodes, key=lambda n: position[id(n)]))
            build.added += restore_build.added
            new = ", ".join(f"{n.op_type} '{n.name}'" for n in restore_build.added)
            restore_lines.append(f"{restore.describe()} -> {new}")
        removed = remove_dead(graph, reversed(pattern + [n for r in group.restores for n in r.nodes]))
        entry.status, entry.rule = "converted", tokens.rule.name
        entry.counts = tokens.counts.describe()
        entry.movement = movement
        entry.rerouting = rerouting.name
        entry.removed, entry.added = removed, [n.name or n.op_type for n in build.added]
        entry.restores = restore_lines
        slots = (("per_token_scales", group.scales), ("expert_topk_weight", group.weight))
        for slot, sort in slots:
            if sort is not None:
                entry.folded.append(f"{sort.label} rows ({sort.rule.name}) as {slot}")
        report_entries = {e.node: e for e in self.report.entries}
        for slot, sort in slots:
            if sort is not None and sort.all_to_all.name in report_entries:
                report_entries[sort.all_to_all.name].reasons.append(
                    f"folded into MoeReRoutingV2 '{rerouting.name}' of {tokens.label} as {slot}"
                )
                report_entries[sort.all_to_all.name].rerouting = rerouting.name


def _error_text(error: Exception) -> str:
    """``Type: first line of the message`` (at most 200 characters of it)."""
    first_line = str(error).splitlines()[0][:200] if str(error).strip() else ""
    return f"{type(error).__name__}: {first_line}" if first_line else type(error).__name__


def _merged(reasons: list[str], rules: tuple[Rule, ...]) -> list[str]:
    """``"a: why"``, ``"b: why"`` -> ``"a, b: why"`` (rules sharing a first step skip for one reason)."""
    names = {rule.name for rule in rules}
    by_why: dict[str, list[str]] = defaultdict(list)
    for reason in reasons:
        name, _, why = reason.partition(": ")
        if name in names:
            by_why[why].append(name)
        else:
            by_why[reason] = []
    return [f"{', '.join(said_by)}: {why}" if said_by else why for why, said_by in by_why.items()]


def _rows(sort: ChunkSort, build: Builder) -> ir.Value:
    """The received rows as ``[A, *row_dims]`` (a Reshape when the AllToAll moved blocks)."""
    if not sort.view_rows:
        return sort.received
    assert sort.row_dims is not None and all(d is not None for d in sort.row_dims)
    return build.reshape(sort.received, [-1, *(d for d in sort.row_dims if d is not None)], "rows")


def _counts(sort: ChunkSort, rows: ir.Value, build: Builder) -> ir.Value:
    counts = sort.counts
    if counts.constant is not None:
        return build.ints("counts", counts.constant)
    if counts.capacity:  # full([N, L], A / (N*L)), A the rows received
        assert counts.ranks is not None
        shape = build.node("Shape", [rows], what="rows_shape").outputs[0]
        total = build.node("Slice", [shape, build.ints("first", [0]), build.ints("one", [1])], what="rows").outputs[0]
        blocks = build.ints("blocks", [counts.ranks * counts.experts])
        per_block = build.node("Div", [total, blocks], what="capacity").outputs[0]
        return build.node("Expand", [per_block, build.ints("counts_shape", [counts.ranks, counts.experts])]).outputs[0]
    assert counts.value is not None
    if counts.flat:
        assert counts.ranks is not None
        return build.reshape(counts.value, [counts.ranks, counts.experts], "counts")
    return counts.value


def _role(sort: ChunkSort) -> str:
    """tokens ([A, H] or unknown), scales ([A] float), weight ([A, 1] float32), other."""
    dims, dtype = sort.row_dims, sort.dtype
    if dims is None:
        return "tokens"
    if len(dims) == 0:
        return "scales" if dtype in _SCALE_TYPES else "other"
    if tuple(dims) == (1,) and dtype == ir.DataType.FLOAT:
        return "weight"
    return "tokens" if len(dims) == 1 else "other"


def _rows_text(sort: ChunkSort) -> str:
    dims, dtype = sort.row_dims, sort.dtype
    shape = "?" if dims is None else "[" + ", ".join(["A", *(str(d) for d in dims)]) + "]"
    return f"{shape} {dtype.name.lower() if dtype is not None else ''}".strip()


def _counts_of(all_to_all: ir.Node, sorts: list[tuple[AllToAllReport, ChunkSort]]) -> str:
    """The label of the first chunk sort whose computed counts ``[N, L]`` are computed from
    ``all_to_all``'s received data (torchtitan exchanges its per-expert counts so), or ""."""
    received = id(all_to_all.outputs[0])
    for _, sort in sorts:
        if sort.counts.value is not None and received in _upstream(sort.counts.value):
            return sort.label
    return ""


def _upstream(value: ir.Value) -> set[int]:
    """Ids of ``value`` and of every value it is computed from."""
    return {id(v) for v in upstream(value)}


def _independent(a: ChunkSort, b: ChunkSort) -> bool:
    """Neither sort's rows are computed from the other's result (one node may take both)."""
    above_a, above_b = _upstream(a.received), _upstream(b.received)
    return not any(id(v) in above_b for v in a.outputs) and not any(id(v) in above_a for v in b.outputs)


def _rerouted(received: ir.Value) -> bool:
    """Whether the rows already reach a MoeReRoutingV2 / MoeReRouting (through views only)."""
    pending = [received]
    while pending:
        value = pending.pop()
        for use in value.uses():
            node = use.node
            if node.domain == DOMAIN and node.op_type in ("MoeReRoutingV2", "MoeReRouting"):
                return True
            if node.op_type in _VIEWS and is_standard(node) and use.idx == 0:
                pending.extend(node.outputs)
    return False


def _topologically_sorted(graph: ir.Graph) -> bool:
    produced = {id(v) for v in graph.inputs} | {id(v) for v in graph.initializers.values()}
    for node in graph:
        for value in node.inputs:
            if value is not None and value.producer() is not None and id(value) not in produced:
                return False
        produced.update(id(v) for v in node.outputs)
    return True


__all__ = ["RULES", "ConversionReport", "Group", "InsertRerouting"]
