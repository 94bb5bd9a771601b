"""Benchmarks: one command each, run by hand, never as tests (STYLE.md practice 10).

Each command prints a table (median and spread over repeats, the command line,
the machine) and rewrites its own section of docs/BENCHMARKS.md.
"""
