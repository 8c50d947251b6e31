"""The exceptions of data_tools: each message is one line naming the file, dataset and example at fault."""


class DataError(ValueError):
    """A dataset file or input is missing, unreadable or malformed."""


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or damaged."""


class DataWarning(UserWarning):
    """Something was written without a part that could not be made (one line: which part, and why)."""
