# mps-exporter: generated monitoring files (alert rules, dashboards) and checks.
# Generated files are committed; `make check-generated` (and the pytest suite)
# fail when regenerating would change them.
PYTHON ?= python3

.PHONY: all generate check-generated lint test test-fast
all: generate lint test

generate:
	$(PYTHON) -m alerts.generate
	$(PYTHON) -m dashboards.generate
	$(PYTHON) -m alerts.mixin
	$(PYTHON) deploy/kubernetes/generate.py
	$(PYTHON) docs/generate.py
	$(PYTHON) -m tests.support.golden

check-generated:
	$(PYTHON) -m alerts.generate --check
	$(PYTHON) -m dashboards.generate --check
	$(PYTHON) -m alerts.mixin --check
	$(PYTHON) deploy/kubernetes/generate.py --check
	$(PYTHON) docs/generate.py --check
	$(PYTHON) -m tests.support.golden --check

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m mypy --strict exporter alerts dashboards
	promtool check rules alerts/prometheus/mps-exporter.rules.yml
	amtool check-config alerts/alertmanager.example.yml

test:
	promtool test rules alerts/tests/*.yaml
	$(PYTHON) -m pytest -q

# The inner loop (CONTRIBUTING.md: at most 150 s on a 2-core machine): the tests not marked
# slow, spread over TEST_WORKERS pytest-xdist workers (auto: one per core). Bytecode is kept
# in __pycache__ (git ignores it) even where PYTHONDONTWRITEBYTECODE is set: without it each
# worker rewrites every test module's asserts again (7 s of CPU) and each CLI test's process
# compiles the package again.
TEST_WORKERS ?= auto
test-fast:
	PYTHONDONTWRITEBYTECODE= $(PYTHON) -m pytest -q -m "not slow" -n $(TEST_WORKERS) -p no:cacheprovider
