"""The diagnosis Event's text ends with a command that fetches the full report: pasted as is, it must
find the report in the job's namespace, not in the reader's current one."""

from __future__ import annotations

import shlex

from rankwatch.operator.diagnosis.report.writer import event_message, report_configmap_name


def test_the_report_hint_names_the_jobs_namespace():
    message = event_message("rank 3 stopped", 0.95, "team-a", "llama", "cause unknown: no figure")
    command = message[message.index("kubectl") : -1]
    words = shlex.split(command)
    assert words[:3] == ["kubectl", "get", "configmap"]
    assert words[words.index("-n") + 1] == "team-a" and report_configmap_name("llama") in words
