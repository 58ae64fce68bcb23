"""Micro-benchmarks that print figures (never timed tests): `python -m megaroute.bench.<name>`."""
