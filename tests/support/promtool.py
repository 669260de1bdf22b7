"""`promtool test rules` over a rule file, with its groups evaluated in the file's order.

Without `group_eval_order`, promtool 2.42 evaluates the groups of a step in Go's map
order, which changes from run to run: a record that reads another group's record then
reads this step's value in one run and the previous step's in the next (the `fleet-totals`
group read `fleet`'s records a minute late in about one run of four). Prometheus itself
runs each group on its own timer, so no order is "right"; the file's order is the one a
test can state.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import List

import yaml

from tests.support.tools import require


def group_order(rules_yaml: str) -> List[str]:
    """The rule file's group names, in the file's order."""
    return [g["name"] for g in yaml.safe_load(rules_yaml)["groups"]]


def run_rule_tests(workdir: Path, rules_yaml: str, test_file: dict, name: str = "rules.test.yml",
                   timeout: float = 300) -> subprocess.CompletedProcess:
    """Writes `rules_yaml` as rules.yml and the test file (promtool's fields but
    `rule_files` and `group_eval_order`, which this sets) beside it; runs promtool."""
    (workdir / "rules.yml").write_text(rules_yaml)
    test_file = {"rule_files": ["rules.yml"], "group_eval_order": group_order(rules_yaml), **test_file}
    (workdir / name).write_text(yaml.safe_dump(test_file, width=1_000_000))
    return subprocess.run([require("promtool"), "test", "rules", name], cwd=workdir,
                          capture_output=True, text=True, timeout=timeout)
