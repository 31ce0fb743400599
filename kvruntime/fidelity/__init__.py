"""Fidelity harness: how faithful is each KV operation to full recompute, per model.

``kvnotes eval fidelity --model NAME`` runs the shipped case set (``kvruntime/evalsets``),
prints a table per operation and writes ``kvruntime/fidelity/tables/<model>.json``; the planner
reads the per-model summary to decide which operations it may trust: erratum vs edit-in-place, and
what ``balanced`` may compose (section ``compose_answers``: answers and decisions vs recompute
with 95% intervals, ``methods.answers_section``; the statistics in ``method_stats``).
"""
