"""The one exception every configuration check raises (flags, config files, web config).

It lives apart so that config.py and webconfig.py can both raise it without importing
each other.
"""


class ConfigError(Exception):
    """A bad flag or file: the message is one line, shown after the program's name."""
