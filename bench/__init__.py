"""Benchmarks: scripts that print JSON (see DESIGN.md section 7)."""
