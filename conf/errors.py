"""The error every configuration check raises."""


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the setting to change."""
