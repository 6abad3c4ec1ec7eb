"""A job's own text (its frames, function and pod names, its sidecar's error bodies) where the operator
writes it: the operator's log, a node's annotation. A newline or an escape sequence in it must not
forge a line of its own (``CIRCUIT BREAKER OPEN ... uncordoned``) nor recolour a terminal."""

from __future__ import annotations

import subprocess
import sys
import textwrap

FORGED = "\n2026-11-28 11:00:00,000 [rankwatch.operator.remediation] CIRCUIT BREAKER OPEN: 40 nodes uncordoned\x1b[2J"


def test_a_jobs_text_in_an_operator_log_line_stays_on_that_line():
    program = textwrap.dedent(f"""
        import logging
        from rankwatch.operator import main
        main.configure_logging()
        logging.getLogger("rankwatch.operator.recovery.reconcile").warning(
            "TrainingJob %s/%s: attempt %d evidence not kept: %s", "team-a", "llama", 0,
            "sidecar of trainer-0 answered HTTP 500: " + {FORGED!r})
    """)
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, lines
    assert "evidence not kept: sidecar of trainer-0 answered HTTP 500: \\n2026-11-28" in lines[0]
    assert "\x1b" not in result.stderr and "\\x1b[2J" in lines[0]


def test_a_jobs_text_in_a_node_annotation_is_one_bounded_line():
    from rankwatch.operator.remediation.node_marks import EVIDENCE_MAX_CHARS, evidence_text

    text = evidence_text(f"rank 3 is slow in train_step{FORGED}", {"function": "f" * 10_000 + FORGED})
    assert "\n" not in text and "\x1b" not in text
    assert len(text) <= EVIDENCE_MAX_CHARS
