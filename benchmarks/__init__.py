"""Side-by-side benchmark of DDP + compile modes (`python -m benchmarks`); not part of the installed library."""
