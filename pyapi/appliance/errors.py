"""What a caller of the appliance catches: types, so no caller reads an error's text to decide."""
from wse_core.errors import ConfigError, JobError


class ApplianceError(JobError):
    """The appliance refused a request or cannot be reached (one line). A JobError: the service that runs
    the jobs failed the caller (a RuntimeError, as before)."""


class ApplianceRunning(ApplianceError):
    """An appliance already answers at the socket a new one was to listen on."""


class RequestError(ConfigError):
    """A request the service refuses; the message is the one line the caller sees. A ConfigError: the
    request is what its caller wrote and changes (a ValueError, as before)."""
