"""The error a failed training job raises, below both the Job API and the appliance's client.

``pyapi.job`` re-exports it (``pyapi.job.JobError`` is the name users know); it lives here so the
appliance's client can raise it without importing ``pyapi.job``, which imports the client.

A subclass of the project's job kind (``wse_core.errors.JobError``), not that kind itself: a caller of
``Job`` that catches this one catches a training job's failure, not every rank's or launcher's.
"""
from wse_core.errors import JobError as _JobKind


class JobError(_JobKind):
    """A training job failed; the message is one line naming the rank, its role and what happened."""
