"""The serving load generator behind `tokenmill bench serve` (serve.py), shared with the
peer benchmarks of benchmarks/serving/: workloads (synthetic shapes, scaled trace replays),
an async HTTP client that records per-token timings, and the summary statistics."""
