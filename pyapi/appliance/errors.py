"""What a caller of the appliance catches: types, so no caller reads an error's text to decide."""


class ApplianceError(RuntimeError):
    """The appliance refused a request or cannot be reached (one line)."""


class ApplianceRunning(ApplianceError):
    """An appliance already answers at the socket a new one was to listen on."""


class RequestError(ValueError):
    """A request the service refuses; the message is the one line the caller sees."""
