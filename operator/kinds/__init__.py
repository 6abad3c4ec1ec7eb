"""Jobs of other kinds (an Indexed Job, ...): pods opt in, an admission webhook injects what a
TrainingJob's pods get, one small adapter per kind says how to find the group and each pod's place."""
