"""Benchmark tooling of ``fleetlease bench``."""
