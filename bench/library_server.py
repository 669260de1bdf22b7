"""A well-kept Python HTTP server library serving a Prometheus registry, for
bench/flood_bench.py's comparison (`--kinds cheroot waitress`): the same flood cases
against cheroot (CherryPy's server: thread pool, keep-alive connections parked in a
selector, TLS) and waitress (Pylons: asyncore loop, a connection limit, no TLS).

    python3 bench/library_server.py cheroot|waitress PORT

Needs the library (pip install cheroot / waitress); the exporter does not.
"""

from __future__ import annotations

import sys

from prometheus_client import make_wsgi_app


def main() -> None:
    kind, port = sys.argv[1], int(sys.argv[2])
    app = make_wsgi_app()  # the default registry: process and platform metrics
    if kind == "cheroot":
        from cheroot import wsgi

        server = wsgi.Server(("127.0.0.1", port), app, numthreads=10)
        server.start()
    else:
        import waitress

        waitress.serve(app, host="127.0.0.1", port=port, threads=4, _quiet=True)


if __name__ == "__main__":
    main()
