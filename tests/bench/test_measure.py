"""bench/measure.py's clocks and its count of the bytes kept for the backward pass."""

from __future__ import annotations

import time

import pytest
import torch

from fastweights.bench import measure

CPU = torch.device("cpu")


def test_clocks_time_a_call():
    """Sleeping costs wall time, not CPU time; spinning costs both."""
    wall, process, thread = measure.time_clocks(lambda: time.sleep(0.05), CPU,
                                                ("wall", "process", "thread"))
    assert wall >= 0.05 and process < 0.04 and thread < 0.04
    assert measure.time_call(lambda: time.sleep(0.02), CPU) >= 0.02
    assert measure.time_call(lambda: time.sleep(0.02), CPU, clock="thread") < 0.015

    def spin() -> None:
        end = time.thread_time() + 0.03
        while time.thread_time() < end:
            pass

    assert measure.time_call(spin, CPU, clock="thread") >= 0.03
    with pytest.raises(ValueError, match="clock must be one of wall, process, thread"):
        measure.time_call(spin, CPU, clock="cpu")
    with pytest.raises(ValueError, match="clocks must be some of"):
        measure.time_clocks(spin, CPU, ())


def test_saved_bytes_counts_each_storage_once():
    x = torch.randn(64, 32, requires_grad=True)  # 8 KiB
    w = torch.randn(32, 16, requires_grad=True)  # 2 KiB
    # mm saves both operands; x used twice still counts once
    assert measure.saved_bytes(lambda: (x @ w).sum() + (x * 2).sum()) == 64 * 32 * 4 + 32 * 16 * 4
    with torch.no_grad():
        assert measure.saved_bytes(lambda: x @ w) == 0


def test_peak_memory_reports_the_high_water_mark():
    if not measure.prepare_cpu_memory_accounting():
        pytest.skip("no CPU memory accounting here (not Linux/glibc)")
    with measure.PeakMemory(CPU) as mem:
        a = torch.ones(4 * 2**20)  # 16 MiB, touched
        del a
    assert mem.peak >= 15 * 2**20 and mem.high >= mem.peak
