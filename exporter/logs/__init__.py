"""The MPS log pipeline: follow control.log and server.log, parse, keep state, render.

parser.parse_line (pure) -> state.LogState (pure) -> pipeline.LogPipeline (thread,
follower, state file) -> render.render_log_metrics. The snapshot a scrape reads is
plain data in model.py. This package imports none of its modules itself, so that the
pure join (render.py, through logs/render.py) does not load the follower and the
pipeline: import the module you use.
"""
