"""rtckern's benchmarks: one runner (`python -m benchmarks FAMILY`, benchmarks/runner.py) over one suite per family
(benchmarks/<family>.py); helpers of a suite are `_`-prefixed modules; results in benchmarks/results/."""
