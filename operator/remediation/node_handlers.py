"""kopf handler on Nodes: the annotation-driven undo (``rankwatch.io/uncordon=true``), kept thin.

An event handler, not a change handler: it stores no progress on the node (kopf would otherwise
write its own annotations onto every node) and needs no finalizer. kopf lists and watches all
nodes (it has no server-side annotation filter), but the handler only runs for nodes carrying the
request; the undo removes the request, so it runs once per request, also for requests made while
the operator was down (they show up in the initial listing). Nodes are cluster-scoped: kopf
watches them cluster-wide, but, when run with ``--namespace`` globs, only once a namespace it
serves exists (kopf pairs each resource with the served namespaces).
"""

from __future__ import annotations

from typing import Any

import kopf

from rankwatch.operator.remediation import cordon, node_marks


@kopf.on.event("nodes", annotations={node_marks.UNCORDON_REQUEST: "true"})
async def uncordon_requested(name: str, logger: kopf.Logger, memo: kopf.Memo, **_: Any) -> None:
    result = await cordon.uncordon_async(memo.kube, name, via="annotation", metrics=memo.metrics.remediation)
    logger.info("uncordon requested by annotation: %s", result.message)
