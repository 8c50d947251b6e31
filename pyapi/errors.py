"""The error a failed training job raises, below both the Job API and the appliance's client.

``pyapi.job`` re-exports it (``pyapi.job.JobError`` is the name users know); it lives here so the
appliance's client can raise it without importing ``pyapi.job``, which imports the client.
"""


class JobError(RuntimeError):
    """A training job failed; the message is one line naming the rank, its role and what happened."""
