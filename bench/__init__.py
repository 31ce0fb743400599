"""Benchmarks: speed and memory goals, printed as ratios measured side by side in one run."""
