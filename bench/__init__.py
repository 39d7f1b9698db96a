"""Benchmarks (not tests): each prints its numbers; results go to docs/PERFORMANCE.md."""
