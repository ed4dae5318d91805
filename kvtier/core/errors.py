"""kvtier's error types shared by its layers."""


class ConfigError(ValueError):
    """A configuration problem; the message names the source, the field and the cause."""
