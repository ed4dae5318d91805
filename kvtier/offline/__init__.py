"""Offline analysis: traces, replay, simulation, Belady, workloads, sizing."""
