"""A rule that cannot evaluate one all-to-all's region (a sequence value, a Loop: forms
onnx.reference or numpy refuse) skips that all-to-all with its reason; the others convert."""

from __future__ import annotations

from moe_onnx.converters import MovementMap, insert_rerouting
from moe_onnx.models.ep_layer import LayerConfig, build_rank_model, make_weights


def test_a_rule_that_fails_on_one_all_to_all_skips_only_it(monkeypatch):
    config = LayerConfig(ranks=2)
    model = build_rank_model(config, make_weights(config), 0, "split_concat")
    _, before = insert_rerouting(model)
    assert before.entries[1].status == "converted"
    match = MovementMap.match

    def failing(self, received, facts, world):
        if received.producer().name == "all_to_all_dispatch":
            raise ValueError("setting an array element with a sequence.")
        return match(self, received, facts, world)

    monkeypatch.setattr(MovementMap, "match", failing)
    converted, report = insert_rerouting(model)
    by_name = {entry.node: entry for entry in report.entries}
    skipped = by_name["all_to_all_dispatch"]
    assert skipped.status == "skipped"
    assert any("ValueError: setting an array element with a sequence" in r for r in skipped.reasons)
    assert converted is model  # nothing else to convert: the model given comes back unchanged
