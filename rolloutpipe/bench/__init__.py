"""Benchmark suites (``rolloutpipe bench --suite ...``) and their models."""
