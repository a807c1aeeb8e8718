"""What a conversion raises. The model it was given is left exactly as it was in every case."""

from __future__ import annotations


class ConversionError(ValueError):
    """A conversion that could not be done safely; the message names the nodes."""


class AmbiguousMatch(ConversionError):
    """A candidate matches in more than one way (two restores, two rules, two tokens for one probs...)."""


class BatchSpecificGraph(ConversionError):
    """``strict``: the graph only holds for the batch it was traced with (constant split sizes after
    an all-to-all whose send counts are computed)."""


class Skip(Exception):
    """Raised by a rule: the candidate looked like its pattern but is not it (the message says why)."""


class BatchSpecific(Skip):
    """Raised by a rule: the rows are split by sizes traced as constants from one batch."""
