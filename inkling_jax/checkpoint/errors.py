"""The error every checkpoint problem raises."""


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names the tensor."""
