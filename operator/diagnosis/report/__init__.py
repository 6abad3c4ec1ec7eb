"""Report: what a diagnosis found (and a silent job's NoTelemetry) written on the TrainingJob, its
Events and report, and the per-job metrics."""
