"""Benchmarks: one command each, run by hand, never as tests.

Each command prints a table (median and spread over repeats, the command line,
the machine) and rewrites its own section of docs/BENCHMARKS.md.
"""
