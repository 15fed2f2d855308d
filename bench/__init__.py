"""wheeld's benchmarks: each prints a table and writes JSON into bench/runs/ (ignored by git),
or into bench/results/ (the recorded figures the docs quote) when run with ``--save``
(bench/common.py, ``results_path``)."""
