"""Detect: cheap suspicions from the per-job state, every window (whether to look closer)."""
