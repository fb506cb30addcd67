"""Benchmarks: scripts that print JSON, one object a run, so that figures are compared by key."""
