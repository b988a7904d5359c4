"""The evaluation command line's error type (shared by `eval.__main__` and `eval.model_source`)."""


class UsageError(ValueError):
    """A bad command-line value; the message names the flag and the value."""


def require(ok: bool, message: str) -> None:
    """Raise `UsageError(message)` unless `ok`."""
    if not ok:
        raise UsageError(message)
