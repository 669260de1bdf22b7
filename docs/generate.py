#!/usr/bin/env python3
"""Write the blocks of README.md and docs/labels.md that come from the code.

    python3 docs/generate.py           # rewrite the blocks
    python3 docs/generate.py --check   # exit 1 if one is stale

Each block sits between `<!-- NAME:begin -->` and `<!-- NAME:end -->` lines and
is replaced whole: README's metric tables (`metrics`) and docs/labels.md's label
table (`labels`), both from mps_exporter.catalog (every declared metric and
label), README's table of the collectors and their flags (`collector-flags`, from
the sources), of the global flags (`flags`, from the parser of `serve` and the
`Config` defaults it reads) and README's useful queries (`useful-queries`, from
dashboards/useful_queries.py), and docs/performance.md's table of issue 44's figures
(`figures`, from the records the benches write: bench/figures.py). Edit the declarations, not the blocks. `make generate`
runs this.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]


def blocks() -> Dict[str, Tuple[str, Callable[[], str]]]:
    """Block name -> (file relative to the repository, the block's text)."""
    if str(ROOT) not in sys.path:  # run as a script: dashboards/ (the useful queries) beside docs/
        sys.path.insert(0, str(ROOT))
    from bench import figures
    from dashboards import useful_queries
    from mps_exporter import catalog

    return {
        "metrics": ("README.md", catalog.metrics_markdown),
        "labels": ("docs/labels.md", catalog.labels_markdown),
        "collector-flags": ("README.md", catalog.collector_flags_markdown),
        "flags": ("README.md", global_flags_markdown),
        "useful-queries": ("README.md", useful_queries.markdown),
        "figures": ("docs/performance.md", figures.markdown),
    }


# README's longer word on a global flag, where its --help text is not enough (links, reasons,
# how it interacts with the others). The flag names, their defaults and every other flag's
# meaning come from the parser; a name here that is no flag fails `make generate`.
FLAG_DOCS: Dict[str, str] = {
    '--web.listen-address': (
        "address to listen on. 10138: the 9100-9999 block of Prometheus' default port allocations is full; new "
        'exporters are allocated from 10000 up and 10138 was not taken there'),
    '--web.systemd-socket': (
        'serve on the socket systemd passes (socket activation: a `.socket` unit or `systemd-socket-activate`) '
        'instead of binding `--web.listen-address`, as node_exporter and dcgm-exporter offer '
        '([docs/deploy.md](docs/deploy.md))'),
    '--web.disable-exporter-metrics': (
        "leave the exporter's own `process_*` metrics (CPU, memory, open files of the exporter process) out of "
        "`/metrics`, as exporter-toolkit's flag does; the collectors' own series "
        '(`mps_exporter_collector_success` and the rest, which the alerts use) stay'),
    '--web.config.file': (
        'TLS and basic auth, in the Prometheus exporter-toolkit format (below)'),
    '--web.max-requests': (
        "scrapes served at once; past it `/metrics` answers 503 at once (node_exporter's flag; `0`: no limit)"),
    '--scrape.max-duration': (
        'seconds a scrape waits for the sources (`0`: no limit). A source still reading then fails its collector '
        '(`mps_exporter_collector_success 0`) and its last complete reading is served, marked with its time '
        '(`mps_exporter_collector_last_success_timestamp_seconds`); the late read goes on, and the next scrape '
        'joins it instead of starting another'),
    '--scrape.timeout-offset': (
        "seconds of Prometheus' scrape timeout (`X-Prometheus-Scrape-Timeout-Seconds`) kept for encoding and "
        'sending: the sources get the timeout less this (half the timeout where that leaves less), at most '
        '`--scrape.max-duration`'),
    '--collector.refresh-interval': (
        'seconds between background reads of the sources that are slow or slow down in a client storm (NVML: GPU '
        'table, process lists, utilization, GPM; DCGM). A scrape serves their latest reading while it is at most '
        'two intervals old, plus the time the next read has taken (its time in '
        '`mps_exporter_collector_last_success_timestamp_seconds`) and reads like any other source when it is '
        'older. Scraped 1.5 intervals apart or more (a 15 s scrape), they are read once per scrape, shortly '
        'before the scrape the spacing of the last ones says comes next '
        '(`mps_exporter_collector_refresh_interval_seconds` shows that pace). `0`: read them in every scrape. '
        'Control-daemon commands are never sent on a timer'),
    '--collector.control-wait': (
        "seconds a scrape waits for the control daemon's answers (`get_server_list`, `ps`, ...). Not there by "
        'then (while MPS admits a storm of clients `ps` takes up to 0.5 s), the scrape serves their last reading,'
        ' its time in `mps_exporter_collector_last_success_timestamp_seconds`, and the read ends for the next '
        'scrape; after an answer slower than the wait, scrapes do not wait for the daemon for 10 s (in a storm '
        "its answers hover about the wait); a read running past the scrape's own budget fails the collector as "
        'any late source does. Settled, a control read takes 4-13 ms and every scrape serves its own. `0`: wait '
        'as for any source. Commands are still sent by scrapes only, never on a timer'),
    '--collector.pause-after': (
        'seconds without a scrape after which the background reads pause (an exporter nobody scrapes reads '
        'nothing); the next scrape reads at once and resumes them'),
    '--mps.pipe-directory': (
        'pipe directory of the control daemon (with `--mps.discover`: watched only where given)'),
    '--mps.log-directory': (
        "the control daemon's log directory (`control.log`, `server.log`)"),
    '--config.file': (
        'YAML listing several control daemons and discovery roots (overrides `--mps.pipe-directory` and `--mps.log-directory`)'),
    '--mps.discover': (
        "find the daemons NVIDIA's Kubernetes software starts, as they come and go: `device-plugin`, `dra` or "
        'both, comma-separated '
        '([docs/deploy.md](docs/deploy.md#mps-started-by-nvidias-device-plugin-or-dra-driver))'),
    '--mps.discover.device-plugin-root': (
        "the device plugin's `mps.root`, as the exporter sees it; daemons at `ROOT/<resource name>/{pipe,log}`"),
    '--mps.discover.dra-root': (
        "the DRA driver's kubelet plugins directory, as the exporter sees it; daemons at "
        '`ROOT/gpu.nvidia.com/mps/<claim UID>-<hash>/{pipe,log}`'),
    '--mps.discover-processes': (
        'also watch every `nvidia-cuda-mps-control -d\\|-f` process on the host, wherever it was started (ECS, '
        'Slurm, GKE, pods): directories from its environment, through `/proc/PID/root`; one a flag or layout '
        'names keeps that name; `--no-mps.discover-processes` turns it off '
        '([docs/deploy.md](docs/deploy.md#every-control-daemon-on-the-host-found-by-its-process))'),
    '--mps.discover-interval': (
        'seconds between scans for daemons that came or went (MPS v3, driver r615 and later, is not read yet: '
        '[docs/mps-v3.md](docs/mps-v3.md))'),
    '--mps.client-granularity': (
        '`client`: series per MPS client process (`pid` label); `pod`: client memory, limits and counts summed '
        'per MPS server and pod, no `pid`; `server`: client memory and limits summed per MPS server (with the '
        "fullest client's share of its limit), no `pid` or pod: 10 to 11x fewer series on an 8 GPU x 48 client "
        'node ([docs/cardinality.md](docs/cardinality.md))'),
    '--mps.oom-margin-ratio': (
        'a client that exits with its last memory reading within this share of its pinned limit in force counts '
        'in `mps_client_exits_at_memory_limit_total{reason="client_limit"}` (0.05: an H100 client at 95 % of 2 '
        'GiB died asking 1 GiB more, issue 40)'),
    '--mps.device-full-ratio': (
        "one that exits while its GPU's used memory was at least this share of the total counts with "
        '`reason="device_full"` (a fifth client asking 6 GiB of a GPU filled to 97.5 % died)'),
    '--mps.exit-status': (
        "ask the kernel how clients ended (the proc connector over netlink: the host's PID namespace, and "
        'CAP_NET_ADMIN before Linux 6.6, which the Helm chart does not add): `outcome` `failed` or `clean`; '
        'elsewhere, or with `--no-mps.exit-status`, `unknown`. `serve` and `status --watch`'),
}


def _default_text(action: argparse.Action) -> str:
    """A global flag's default as README says it: on/off for a switch, its value, else none."""
    if isinstance(action, argparse._StoreTrueAction) or isinstance(action, argparse._StoreFalseAction):
        return "on" if action.default else "off"
    if action.default is None:  # a default that depends on the environment: the help says it
        said = re.search(r"\(default: ([^;)]*)", action.help or "")
        if said:
            return re.sub(r"([$/][^ ]+)", r"`\1`", said.group(1).strip())
    from mps_exporter.catalog import _default

    return _default(action.default if action.default != [] else None)


def _help_text(action: argparse.Action) -> str:
    """The flag's --help text without its default (that is the next column)."""
    text = (action.help or "").replace("%(default)s", "")
    text = re.sub(r"\s*\(default[: ][^)]*\)", "", text)
    text = re.sub(r";\s*default[: ][^)]*\)", ")", text).replace("%%", "%").strip()
    if action.choices:
        text = (text + ": " if text else "") + ", ".join(f"`{c}`" for c in action.choices)
    return text


def global_flags_markdown() -> str:
    """README's table of the flags of `serve` that no source declares: every one the parser
    has (its `--no-` twin beside it), its default as the parser holds it (the `Config`
    field's), and its meaning from FLAG_DOCS or else its --help text."""
    from mps_exporter.cli import build_parser
    from mps_exporter.sources.registry import SOURCES

    serve = build_parser().serve_parser
    assert serve is not None
    sources = {flag.name for source in SOURCES.values() for flag in source.flags}
    sources |= {f"--{no}collector.{name}" for name in SOURCES for no in ("", "no-")}
    rows: Dict[str, List[Any]] = {}  # dest -> [names, default, meaning]
    for action in serve._actions:
        names = [n for n in action.option_strings if n.startswith("--") and n not in sources and n != "--help"]
        if not names:
            continue
        if action.dest in rows:  # the --no- twin of a switch
            rows[action.dest][0] += names
            continue
        rows[action.dest] = [names, _default_text(action), FLAG_DOCS.get(names[0]) or _help_text(action)]
    unknown = set(FLAG_DOCS) - {names[0] for names, _, _ in rows.values()}
    if unknown:
        raise SystemExit(f"docs/generate.py FLAG_DOCS: no such flag of serve: {', '.join(sorted(unknown))}")
    lines = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for names, default, meaning in rows.values():
        lines.append(f"| {', '.join(f'`{n}`' for n in names)} | {default} | {meaning} |")
    return "\n".join(lines) + "\n"


def replace_block(text: str, name: str, body: str) -> str:
    begin, end = f"<!-- {name}:begin -->\n", f"<!-- {name}:end -->"
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"expected one {begin.strip()} ... {end} pair")
    head, rest = text.split(begin, 1)
    return head + begin + body + end + rest.split(end, 1)[1]


def outputs(root: Path = ROOT) -> Dict[str, str]:
    """File relative to root -> its text with every block regenerated."""
    files: Dict[str, str] = {}
    for name, (rel, body) in blocks().items():
        text = files.get(rel) or (root / rel).read_text(encoding="utf-8")
        try:
            files[rel] = replace_block(text, name, body())
        except ValueError as e:
            raise SystemExit(f"{rel}: {e}") from None
    return files


def main(argv: Optional[List[str]] = None, root: Path = ROOT) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report files that regenerating would change")
    args = parser.parse_args(argv)
    stale = []
    for rel, text in outputs(root).items():
        if (root / rel).read_text(encoding="utf-8") != text:
            stale.append(rel)
            if not args.check:
                (root / rel).write_text(text, encoding="utf-8")
    for rel in stale:
        print(f"{'stale' if args.check else 'wrote'}: {rel}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
