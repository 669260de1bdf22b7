"""The Dockerfile, checked statically (no Docker engine in CI): stages, pinning,
user, labels, and that the build context .dockerignore leaves builds the package."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.deploy.helpers import ROOT

DOCKERFILE = os.path.join(ROOT, "Dockerfile")


def instructions():
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out, pending = [], ""
    with open(DOCKERFILE, encoding="utf-8") as f:
        for line in f:
            stripped = line.strip()
            if not pending and (not stripped or stripped.startswith("#")):
                continue
            if stripped.startswith("#"):
                continue  # comment inside a continued instruction
            if stripped.endswith("\\"):
                pending += stripped[:-1] + " "
                continue
            text = pending + stripped
            pending = ""
            keyword, _, rest = text.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def stages():
    """Instructions grouped per FROM; the global ARGs before the first FROM come first."""
    groups = [[]]
    for keyword, args in instructions():
        if keyword == "FROM":
            groups.append([])
        groups[-1].append((keyword, args))
    return groups


def _dockerignore_regexes():
    rules = []
    with open(os.path.join(ROOT, ".dockerignore"), encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            pattern = line.lstrip("!").strip("/")
            regex = re.escape(pattern).replace(r"\*\*", "\0").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
            rules.append((re.compile("^" + regex.replace("\0", ".*") + "$"), negate))
    return rules


def in_context(relpath: str, rules=None) -> bool:
    """Whether Docker sends this file: the last rule matching it or a parent decides."""
    rules = rules if rules is not None else _dockerignore_regexes()
    parts = relpath.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    included = True
    for regex, negate in rules:
        if any(regex.match(c) for c in candidates):
            included = negate
    return included


def test_multi_stage_with_a_pinned_base():
    groups = stages()
    global_args = dict(a.split("=", 1) for k, a in groups[0] if k == "ARG" and "=" in a)
    base = global_args["PYTHON_IMAGE"]
    # An exact Python release on a named Debian release: never "latest" or "3".
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", base), base
    froms = [args for k, args in instructions() if k == "FROM"]
    assert len(froms) >= 2
    assert all(f.split()[0] == "${PYTHON_IMAGE}" for f in froms)
    # The final stage takes nothing but the wheels from the build stage.
    final = groups[-1]
    assert not any(k == "COPY" for k, _ in final)
    assert any(k == "RUN" and "from=build" in a and "--no-index" in a for k, a in final)


def test_final_stage_user_labels_port_entrypoint():
    from mps_exporter.config import DEFAULT_PORT

    final = dict()
    labels = {}
    for keyword, args in stages()[-1]:
        final[keyword] = args
        if keyword == "LABEL":
            labels.update(re.findall(r'([\w.]+)="([^"]*)"', args))
    uid = final["USER"].split(":")[0]
    assert uid.isdigit() and int(uid) != 0
    assert {"org.opencontainers.image.title", "org.opencontainers.image.description",
            "org.opencontainers.image.licenses", "org.opencontainers.image.version",
            "org.opencontainers.image.revision"} <= labels.keys()
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert final["EXPOSE"] == str(DEFAULT_PORT)
    assert json.loads(final["ENTRYPOINT"]) == ["mps-exporter"]
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        assert re.search(r'^mps-exporter = "mps_exporter\.cli:main"$', f.read(), re.M)
    env = final["ENV"]
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in env


def test_dockerignore_matching():
    rules = _dockerignore_regexes()
    assert in_context("pyproject.toml", rules)
    assert in_context("exporter/config.py", rules)
    assert not in_context("exporter/__pycache__/config.cpython-311.pyc", rules)
    assert not in_context("tests/test_web.py", rules)
    assert not in_context(".git/HEAD", rules)


def test_every_copy_source_is_in_the_context():
    for keyword, args in instructions():
        if keyword != "COPY" or "--from" in args:
            continue
        *sources, _ = args.split()
        for source in sources:
            assert os.path.exists(os.path.join(ROOT, source)), source
            assert in_context(source.rstrip("/")), f"{source} is excluded by .dockerignore"


@pytest.mark.slow
def test_the_context_builds_the_package(tmp_path):
    """What the build stage runs (pip wheel ., build deps fetched from PyPI as in
    the image build), on exactly the files Docker would send."""
    context = tmp_path / "context"
    rules = _dockerignore_regexes()
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel_dir = os.path.relpath(dirpath, ROOT)
        dirnames[:] = [d for d in dirnames if d != ".git"]
        for name in filenames:
            rel = os.path.normpath(os.path.join(rel_dir, name))
            if in_context(rel, rules):
                os.makedirs(context / os.path.dirname(rel), exist_ok=True)
                shutil.copy2(os.path.join(ROOT, rel), context / rel)
    assert not (context / "tests").exists()
    out = tmp_path / "wheels"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), "."],
        cwd=context, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    (wheel,) = out.glob("mps_exporter-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        assert "mps_exporter/config.py" in names and "mps_exporter/cli.py" in names
        # The demo (compose profile `demo`) replays the session shipped as package data.
        data = os.path.join(ROOT, "exporter", "data")
        shipped = sorted(f for f in os.listdir(data) if not f.startswith(".")) if os.path.isdir(data) else []
        assert all(f"mps_exporter/data/{f}" in names for f in shipped), shipped
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        assert "mps-exporter = mps_exporter.cli:main" in zf.read(entry_points).decode()
