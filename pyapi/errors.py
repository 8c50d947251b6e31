"""The errors of the Job API and the appliance's client, below both (and below the appliance's service).

``pyapi.job`` re-exports ``JobError`` (``pyapi.job.JobError`` is the name users know); they live here so
the client (``pyapi.client``) raises them without importing ``pyapi.job``, which imports the client,
and the appliance's service, above the Job it runs, raises the same ones.

A subclass of the project's job kind (``wse_core.errors.JobError``), not that kind itself: a caller of
``Job`` that catches this one catches a training job's failure, not every rank's or launcher's.
"""
from wse_core.errors import ConfigError, JobError as _JobKind


class JobError(_JobKind):
    """A training job failed; the message is one line naming the rank, its role and what happened."""


class ApplianceError(_JobKind):
    """The appliance refused a request or cannot be reached (one line). A JobError: the service that runs
    the jobs failed the caller (a RuntimeError, as before)."""


class ApplianceRunning(ApplianceError):
    """An appliance already answers at the socket a new one was to listen on."""


class RequestError(ConfigError):
    """A request the service refuses; the message is the one line the caller sees. A ConfigError: the
    request is what its caller wrote and changes (a ValueError, as before)."""
