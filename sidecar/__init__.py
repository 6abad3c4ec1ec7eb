"""The per-pod sidecar that reads the NCCL trace rings (see ARCHITECTURE.md, "Data flow")."""
