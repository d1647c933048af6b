"""Measuring: communication (comm: all-reduce latency and bandwidth), this host for the
planner (calibrate: the `this-host` cluster; measure: what runs on the ranks for it and for
benchmarks/validate_planner.py). bench imports the planner's data types; the planner never
imports bench."""
