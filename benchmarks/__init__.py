"""Measured benchmarks of oomb, outside the installed package: run from the repo root as
`python -m benchmarks.NAME` (benchmarks/README.md). Nothing in `oomb` imports this folder."""
