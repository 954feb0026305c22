"""Runs an export: sessions per graph, the typed State, prefill → decode, sampling."""
