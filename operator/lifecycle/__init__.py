"""A TrainingJob's lifecycle: the children it owns (token Secret, headless Service, worker pods with
the tracing injection), the status derived from its pods, and the Events on it."""
