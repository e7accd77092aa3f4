"""Acceptance and speed evaluation, benchmarks."""
