"""Ingest: the sidecars' window summaries and stall reports, checked and folded into per-job state."""
