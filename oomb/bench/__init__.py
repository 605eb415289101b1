"""Measured benchmarks: memory and time against context, kernels against baselines."""
