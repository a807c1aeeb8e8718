"""Not implemented yet: no operator is registered from this module."""

DEFINITIONS = []
