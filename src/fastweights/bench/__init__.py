"""Benchmarks: timing, memory and FLOP-rate measurements of ops and mixers, and plots."""
