"""`rankwatch operator`: run the kopf operator with rankwatch's handlers."""

from __future__ import annotations

import secrets

import kopf

# kopf pauses every operator that sees a live peer of the same priority (it cannot tell which one
# should act), so replicas of one Deployment need distinct priorities: each draws one at random,
# the highest is active, the others wait until its peering entry expires (kopf's lifetime, 60 s).
PRIORITY_RANGE = 1_000_000


def random_priority() -> int:
    return 1 + secrets.randbelow(PRIORITY_RANGE)


def run(
    namespaces: list[str],
    standalone: bool,
    liveness: str | None,
    peering: str | None = None,
    priority: int | None = None,
) -> int:
    """Run until stopped. With ``peering`` the named (Cluster)KopfPeering must exist (kopf refuses to
    start otherwise) and only the replica with the highest ``priority`` handles resources."""
    import rankwatch.operator.handlers  # noqa: F401  (registers the handlers)

    if standalone and peering:
        raise SystemExit("rankwatch operator: --standalone and --peering exclude each other")
    if peering and priority is None:
        priority = random_priority()
    kopf.configure(verbose=False)
    kopf.run(
        standalone=standalone,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=liveness,
        peering_name=peering,
        priority=priority,
    )
    return 0
