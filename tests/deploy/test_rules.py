"""The alerting rules: valid for Prometheus (promtool check), behaving as specified (promtool unit
tests of the P0/P1 rules), and each with a level and the annotations a card shows. That every
rankwatch metric they (and the dashboard) read is exported is checked against live scrapes of the
operator and a sidecar, in tests/e2e/test_monitoring.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml
from chart_support import REPO, RULES

RULES_TEST = Path(__file__).parent / "rules_test.yaml"
LEVELS = {"P0", "P1", "P2", "P3"}


def _promtool(promtool_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(promtool_path), *args], capture_output=True, text=True, timeout=300, cwd=REPO)


def test_promtool_check_rules_passes(promtool_path):
    result = _promtool(promtool_path, "check", "rules", "--lint=all", "--lint-fatal", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_of_the_p0_p1_rules_pass(promtool_path):
    result = _promtool(promtool_path, "test", "rules", str(RULES_TEST))
    assert result.returncode == 0, result.stdout + result.stderr


def test_unit_tests_cover_every_p0_and_p1_rule():
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    urgent = {r["alert"] for r in rules if r["labels"]["severity"] in {"P0", "P1"}}
    tests = yaml.safe_load(RULES_TEST.read_text())["tests"]
    firing = {c["alertname"] for t in tests for c in t["alert_rule_test"] if c.get("exp_alerts")}
    assert urgent - firing == set(), f"P0/P1 rules without a firing unit test: {sorted(urgent - firing)}"


def test_every_rule_has_a_level_a_component_and_card_text():
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in LEVELS, rule["alert"]
            assert rule["labels"]["component"] in {"gpu", "node", "network", "kubernetes", "rankwatch"}
            assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
            assert re.fullmatch(r"[A-Z][A-Za-z]+", rule["alert"])
