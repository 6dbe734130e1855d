"""The one exception type users catch."""


class ProbeError(Exception):
    """A bad option, unreadable input or unusable output location.

    Raised before any op is traced; the message names the offending value and
    what would have been accepted.
    """
