"""Benchmarks behind ``qaccel bench``; each returns a JSON-ready dict and may write a PNG."""
