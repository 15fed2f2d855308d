"""wheeld's benchmarks: each prints a table and writes JSON into bench/results/."""
