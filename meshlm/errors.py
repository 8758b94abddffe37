"""The one error type the command line turns into a single line and exit code 2."""


class UsageError(ValueError):
    """Bad user input: a flag, a config file, a checkpoint. The message names the fix."""
