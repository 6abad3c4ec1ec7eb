"""`rankwatch operator`: run the kopf operator with rankwatch's handlers."""

from __future__ import annotations

import kopf


def run(namespaces: list[str], standalone: bool, liveness: str | None) -> int:
    import rankwatch.operator.handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=False)
    kopf.run(
        standalone=standalone,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=liveness,
    )
    return 0
