"""From telemetry to a finding on the job: the collector takes the sidecars' summaries into per-job
state, the detector raises suspicions, the monitor schedules diagnoses (dumps + ``rankwatch.analysis``)
and the writer puts what they find on the TrainingJob."""
