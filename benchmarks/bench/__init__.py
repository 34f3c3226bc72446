"""``python -m benchmarks.bench``: our lookup path and LMCache's, measured side by side."""
