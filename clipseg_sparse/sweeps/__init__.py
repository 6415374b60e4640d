"""Grids over specs, alpha, resolution, models and datasets; the report tables and plots.

May import `methods`, `evaluation` and below."""
