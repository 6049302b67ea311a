"""User-facing errors.

A ``ZooError`` is a problem with the user's input (checkpoint, config, request):
the CLI prints its message alone, without a traceback, and exits non-zero.
Anything else escaping the engine is a bug in zoo and keeps its traceback.
"""


class ZooError(Exception):
    """A problem the user can fix; the message names it."""


class RequestError(ZooError):
    """A single request is invalid; it is rejected, the rest of the batch runs."""


# The exit status of zoo's commands when a setting, the input or the model is bad (a ZooError before any work
# starts: the message says what).
EXIT_BAD_SETTING = 2
