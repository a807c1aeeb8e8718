"""What a conversion raises. The model it was given is left exactly as it was in every case."""

from __future__ import annotations


class ConversionError(ValueError):
    """A conversion that could not be done safely; the message names the nodes."""


class AmbiguousMatch(ConversionError):
    """A candidate matches in more than one way (two restores, two rules, two tokens for one probs...)."""


class BatchSpecificGraph(ConversionError):
    """``strict``: the graph only holds for the batch it was traced with (a chunk sort relies on
    constants that the graph itself contradicts on other batches)."""


class Skip(Exception):
    """Raised by a rule: the candidate looked like its pattern but is not it (the message says why)."""
