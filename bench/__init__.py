"""Benchmarks: each module has a `main()` that prints its figures. `python -m bench` runs all."""
