"""Measurements: communication (all-reduce latency and bandwidth) and end-to-end runs."""
