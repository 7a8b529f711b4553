"""Research diagnostics: one-off measurements that RESULTS.md or BENCHMARKS.md cites (not benchmarks: they set no
speed or memory target). Run as ``python -m research.<module>`` from the project root."""
