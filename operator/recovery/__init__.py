"""Recovery: keep an attempt's evidence, end a hung attempt, restart the job away from its suspects."""
