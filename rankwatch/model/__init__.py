"""The finding model every stage passes on: what the analysis found (:mod:`.finding`), the shared
keys of its evidence (:mod:`.evidence`), what a job keeps of it in ``status.diagnosis``
(:mod:`.diagnosis_status`) and the reasons of the Events that tell of it (:mod:`.event_reasons`).

The bottom of the import graph: it imports nothing else of rankwatch, so the analysis, the operator,
the alerting and the CLI can all speak it (``tests/unit/test_import_graph.py`` holds it there).
"""
