"""Benchmarks: prompt sets and side-by-side runs that report ratios, never lone times."""
