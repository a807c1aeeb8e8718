"""``moe-onnx shard IN OUT --ranks N``: one single-device model file -> ``OUT/rank{r}.onnx``.

Each rank's initializers go to its own ``rank{r}.onnx.data`` beside it, so a rank's files hold
only its weights (the replicated ones and its E / N experts'). Every rank is made before any
is written; the input is never written (:mod:`moe_onnx.commands.model_files`).
"""

from __future__ import annotations

import os

from ..converters import ConversionError, ShardExperts, ShardReport
from ..errors import UserError
from ..ranks.rank_files import RANK_FILE, check_output_folder
from . import model_files


def rank_files(folder: str, rank: int) -> tuple[str, str]:
    """(model path, data file name) of rank ``rank`` in ``folder``."""
    return os.path.join(folder, f"rank{rank}.onnx"), f"rank{rank}.onnx.data"


def shard_file(source: str, folder: str, ranks: int) -> ShardReport:
    """Shard ``source`` over ``ranks`` ranks into ``folder`` (made if missing); returns the
    report. :class:`UserError` for an input that is not a model, a model the pass refuses
    (the message names the node and the rule), an OUT that is a file or would overwrite the
    input, or an OUT holding rank files of more ranks (``moe-onnx run OUT`` would run them too)."""
    check_output_folder(folder, "OUT")
    if os.path.isdir(folder):
        stale = sorted(
            int(m[1]) for name in os.listdir(folder) if (m := RANK_FILE.fullmatch(name)) and int(m[1]) >= ranks
        )
        if stale:
            raise UserError(
                f"OUT {folder} already holds rank{stale[0]}.onnx, a rank past the {ranks} asked for: "
                "`moe-onnx run OUT` would run it too; choose an empty folder"
            )
    model = model_files.load(source)
    for rank in range(ranks):
        target, data_name = rank_files(folder, rank)
        model_files.output_data_name(source, model, target)  # refuses overwriting the input's files
        model_files.output_data_name(source, model, os.path.join(folder, data_name))
    shard = ShardExperts(ranks)
    try:
        shards = shard(model)
    except ConversionError as refused:  # nothing written; the message names the node
        raise UserError(f"{source}: {type(refused).__name__}: {refused}") from refused
    for rank, rank_model in enumerate(shards):
        target, data_name = rank_files(folder, rank)
        model_files.save(rank_model, target, data_name)
    return shard.report
