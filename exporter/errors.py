"""The one exception every configuration check raises (flags, config files, web config).

It lives apart so that config.py and webconfig.py can both raise it without importing
each other.
"""


class ConfigError(Exception):
    """A bad flag or file: the message is one line, shown after the program's name."""


def yaml_error_line(error: Exception) -> str:
    """A PyYAML error in one line with its line and column (1-based, as editors count):
    `line 4, column 1: expected ',' or ']', but got '<stream end>' (while parsing a flow
    sequence at line 3, column 21)`. PyYAML's own text spreads that over several lines,
    the first of which ("while parsing a flow sequence") says neither what nor where."""
    problem = getattr(error, "problem", None)
    mark = getattr(error, "problem_mark", None)
    if not problem:
        lines = str(error).strip().splitlines()
        return lines[0] if lines else type(error).__name__
    text = f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else str(problem)
    context, where = getattr(error, "context", None), getattr(error, "context_mark", None)
    if context:
        text += f" ({context}"
        if where is not None and (mark is None or (where.line, where.column) != (mark.line, mark.column)):
            text += f" at line {where.line + 1}, column {where.column + 1}"
        text += ")"
    return " ".join(text.split())
