"""The TrainingJob operator: kopf handlers, pod construction, job status."""
