"""Acting on a diagnosis: the cordon decision and its safeguards (circuit breaker, limits, opt-out,
cooldown), the node marks and API writes, and the undo (``rankwatch uncordon`` or an annotation)."""
