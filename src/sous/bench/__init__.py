"""Benchmarks: `sous bench serve`, a load generator for any OpenAI-compatible server.

`sous.bench.client` streams one request and times it, `sous.bench.prompts` makes the
fixed, seeded prompt set, `sous.bench.stats` turns timings into vLLM-style figures and
`sous.bench.serve` is the command (a concurrency sweep with JSON output).
"""
