"""The reasons of the Events rankwatch posts, in one place (``kubectl get events --field-selector
reason=...`` and alert rules match on them). A diagnosis's own Warning Event takes the finding's
reason on the job (``Finding.reason``: ``Hang``, ``Straggler``...)."""

from __future__ import annotations

# the job's lifecycle
CREATED = "Created"
INVALID_SPEC = "InvalidSpec"  # also the Failed condition's reason
NAME_CONFLICT = "NameConflict"  # also the Failed condition's reason
SUSPENDING = "Suspending"
RESUMED = "Resumed"
RECREATED = "Recreated"
UNWATCHED = "Unwatched"

# the diagnosis
RECOVERED = "Recovered"
NO_TELEMETRY = "NoTelemetry"
TELEMETRY_RESUMED = "TelemetryResumed"

# remediation (on the job and on the node)
CORDONED_BY_RANKWATCH = "CordonedByRankwatch"
NODE_CORDONED = "NodeCordoned"
CORDON_DRY_RUN = "CordonDryRun"
NODE_CORDON_DRY_RUN = "NodeCordonDryRun"
CORDON_REFUSED = "CordonRefused"
CORDON_FAILED = "CordonFailed"
CORDON_SKIPPED = "CordonSkipped"
CORDON_CAP_REACHED = "CordonCapReached"
CIRCUIT_BREAKER_OPEN = "CircuitBreakerOpen"
UNCORDONED_BY_RANKWATCH = "UncordonedByRankwatch"
NODE_UNCORDONED = "NodeUncordoned"

# recovery
RESTARTING = "Restarting"
RESTART_SKIPPED = "RestartSkipped"
RESTART_LIMIT_REACHED = "RestartLimitReached"
EVIDENCE_NOT_KEPT = "EvidenceNotKept"

# the operator itself
ALERTING_NOT_READY = "AlertingNotReady"
