"""`sluice bench`: load generation against a running Sluice server, its metrics, reports and charts.

workloads.py   seeded prompt/output-length generators (fixed, chat, shared prefix); a seed per run
metrics.py     per-request timelines -> TTFT, TPOT, ITL, end-to-end latency, throughput, goodput,
               prompt tokens served from the prefix cache and computed
runner.py      asyncio load generation (Poisson arrivals or closed loop) through a Transport
transports.py  gRPC Generate, gRPC StreamGenerate (bidi)
report.py      the table, the JSON document (unexpected prefix-cache hits flagged), and `compare`
plot.py        matplotlib charts
cli.py         the `sluice bench` subcommand

`make bench` (Sluice against transformers and against itself with features off) lives in
sluice.benchmarks.serving.baselines.
"""
