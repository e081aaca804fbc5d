"""dgr's benchmarks, each run from the repository root as ``python -m benchmarks.NAME``."""
