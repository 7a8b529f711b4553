"""fedpower benchmark suite: ratios measured within one process run.

Entry point: ``python -m benchmarks.run [--large] [--only server,e2e,framework,client] [--json out.json]``.
See BENCHMARKS.md for the measured table, the commands, the machine and the cost model.
Benchmarks are not tests: nothing here is collected by pytest.
"""
