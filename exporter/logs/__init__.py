"""The MPS log pipeline: follow control.log and server.log, parse, keep state, render.

parser.parse_line (pure) -> state.LogState (pure) -> pipeline.LogPipeline (thread,
follower, state file) -> render.render_log_metrics.
"""

from .parser import parse_line, resolve_timezone
from .pipeline import LogPipeline
from .render import render_log_metrics
from .state import LogServer, LogSnapshot, LogState
from .statefile import StateStore

__all__ = ["parse_line", "resolve_timezone", "LogPipeline", "render_log_metrics", "LogServer",
           "LogSnapshot", "LogState", "StateStore"]
