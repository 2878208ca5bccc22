"""nanoserve's error types.

Every error a user can cause with bad input is a `NanoserveError` whose message names the
bad value and what is allowed. The CLI prints such errors as one line and exits 2; anything
else is a bug and keeps its traceback.
"""


class NanoserveError(ValueError):
    """Bad input: a path, a config, a prompt or a parameter that nanoserve cannot accept."""


class CheckpointError(NanoserveError):
    """A model path or checkpoint file that cannot be loaded."""


class ConfigError(NanoserveError):
    """A model config that is missing a field or names something unsupported."""
