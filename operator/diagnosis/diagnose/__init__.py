"""Diagnose: the dumps of a suspicious job analysed into a finding, with its Python frames, profiles
and node alerts; at most N at once."""
