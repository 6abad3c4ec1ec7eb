"""Prometheus metrics of remediation. Labels are bounded: kind (4), outcome (the Outcome enum), via (3)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class RemediationMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.cordoned = Counter(
            "rankwatch_nodes_cordoned",
            "Nodes rankwatch cordoned and tainted (dry_run=true: only annotated), by finding kind.",
            ["kind", "dry_run"],
            registry=registry,
        )
        self.uncordoned = Counter(
            "rankwatch_nodes_uncordoned",
            "Nodes whose rankwatch cordon was undone, by how the undo was asked for (cli, annotation).",
            ["via"],
            registry=registry,
        )
        self.not_cordoned = Counter(
            "rankwatch_cordons_refused",
            "Named nodes rankwatch did not cordon, by the safeguard that stopped it (or the error).",
            ["outcome"],
            registry=registry,
        )
        self.breaker_tripped = Gauge(
            "rankwatch_circuit_breaker_tripped",
            "1 while the last cordon decision found the cluster-wide circuit breaker open, else 0.",
            registry=registry,
        )
        self.breaker_trips = Counter(
            "rankwatch_circuit_breaker_trips",
            "Cordons refused because the circuit breaker was open.",
            registry=registry,
        )

    @classmethod
    def uncounted(cls) -> RemediationMetrics:
        """Series nobody serves (a private registry): for a caller outside the operator, such as the CLI."""
        return cls(CollectorRegistry())
