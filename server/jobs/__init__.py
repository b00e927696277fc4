"""Batch jobs: a JSONL file of requests run inside the server, durably, on the
capacity online traffic leaves (store.py keeps them, runner.py runs them,
lines.py reads and writes their lines, service.py is their gRPC edge)."""
