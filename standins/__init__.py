"""Stand-ins for what this machine lacks (GPUs, NCCL, a training job), for tests, benches, `make demo` and
the local cluster's pods: the simulator (`rankwatch simulate`, `simulate-pod`), its Python rank and noisy
neighbour, the vectorised Megatron model and the ring writer for synthetic traces, and where the C stand-ins
(nccl_patch/standin) are built. Nothing the operator, the sidecar, the alerting or the analysis runs
imports this package; the runtime image leaves the whole folder out (see the Dockerfile)."""
