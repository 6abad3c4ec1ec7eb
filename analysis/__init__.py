"""Trace readers and hang / straggler / fail-slow detection (see ARCHITECTURE.md, "Detection")."""
