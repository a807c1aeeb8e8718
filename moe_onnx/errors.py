"""Errors of the ``moe-onnx`` commands."""

from __future__ import annotations

from .custom_ops.errors import MoeOpError, OpsetImportError


class UserError(Exception):
    """What a command was given cannot be used (a missing or invalid file, inputs that do not
    fit the model, an output that would overwrite the input). The command prints the message
    as one line and exits with code 2."""


#: errors meaning a command refused what it was given (exit code 2), as opposed to a run that
#: failed (1, with a traceback): an op's or the session's refusal (MoeOpError, FeedError
#: included), a model's missing or wrong cann.moe opset import, a file that is missing or
#: unreadable (OSError), and the commands' own refusals
REFUSALS = (UserError, MoeOpError, OpsetImportError, OSError)
