"""Measurement primitives: time (warm-up + median), peak memory, bytes kept for the backward
pass, FLOP counts, matmul rate. The benchmarks' one timer (``time_call``, ``time_clocks``) and
one memory meter (``PeakMemory``, ``saved_bytes``): no benchmark reads a clock or the memory
statistics itself.

Method notes (also written into every report):

- **Time**: a clock read around one call, after a device synchronise on both sides (CUDA); one
  warm-up call first, then the median of the repeats. The clock is wall time
  (``time.perf_counter``) unless a benchmark asks for CPU time: ``process`` (all threads of
  the process, ``time.process_time``) or ``thread`` (the calling thread only,
  ``time.thread_time``: on a machine shared with other jobs it counts only this thread's
  work).
- **FLOPs**: ``torch.utils.flop_counter.FlopCounterMode`` on one extra call. It counts only
  matrix-multiply-type ATen ops (mm, bmm, addmm, baddbmm, matmul via those, convolutions,
  scaled-dot-product attention) at 2 FLOPs per multiply-add, and nothing elementwise (exp, sums,
  norms, softmax, cumsum). We add formulas it lacks: the CPU flash-attention kernel
  (``_scaled_dot_product_flash_attention_for_cpu`` and its backward, with the dense formula:
  masked blocks are counted as computed) and ``linalg_solve_triangular`` (n^2 k FLOPs for an
  n x n triangle and k right-hand sides), and count the in-place ``baddbmm_`` like ``baddbmm``.
  The count is of the algorithm actually run: a chunked form that builds a full C x C score
  block and then masks it is charged for the full block.
- **Peak memory on CPU**: torch keeps no CPU allocator statistics, so we read the kernel's
  resident-set high-water mark. Before a measured call we reset the high-water
  mark (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0) and note VmRSS; after it we read
  VmHWM; peak = VmHWM - VmRSS(before): the memory the call touched on top of what was resident
  (model, inputs, and for ``decode`` the prefilled state). So that the call's tensors really
  show in the resident set (glibc would otherwise serve them from freed heap blocks that are
  already resident), the memory-probe call runs with glibc's mmap threshold lowered to 64 KiB
  (``mallopt``, after ``malloc_trim``): every tensor above that is a fresh mapping, returned on
  free. That costs page faults (measured +65% on a 20 ms forward), so it is a separate, untimed
  call; timed calls run with the threshold at 32 MiB (glibc's own ceiling), i.e. with the
  allocator's normal reuse. Where any of this is unavailable (not Linux/glibc) memory is
  reported as missing, never guessed.
- **Peak memory on CUDA**: ``torch.cuda.max_memory_allocated`` after
  ``reset_peak_memory_stats``, minus the memory allocated before the call.
- **Bytes kept for the backward pass**: the distinct storages autograd saves during a call
  (``torch.autograd.graph.saved_tensors_hooks``), each counted once.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

__all__ = [
    "CLOCKS",
    "PeakMemory",
    "count_flops",
    "matmul_gflops",
    "prepare_cpu_memory_accounting",
    "saved_bytes",
    "synchronize",
    "time_call",
    "time_clocks",
    "time_rounds",
]

# The clocks a benchmark may time with (module notes).
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter,
                                          "process": time.process_time,
                                          "thread": time.thread_time}

_aten = torch.ops.aten


def _sdpa_cpu_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args,
                            out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _solve_triangular_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    # Forward substitution: each of the k right-hand sides costs ~n^2/2 multiply-adds = n^2 FLOPs.
    n, k = a_shape[-1], out_shape[-1]
    batch = 1
    for size in out_shape[:-2]:
        batch *= size
    return batch * n * n * k


def _baddbmm_inplace_flop(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    # The in-place accumulation the chunked forms use: as baddbmm, 2 b m k n.
    b, m, k = a_shape
    return 2 * b * m * k * b_shape[-1]


_EXTRA_FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flop,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward_flop,
    _aten.linalg_solve_triangular: _solve_triangular_flop,
    _aten.baddbmm_: _baddbmm_inplace_flop,
}


def count_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of the matrix-multiply-type ops ``fn()`` runs (see the module notes)."""
    with FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOP_FORMULAS) as counter:
        fn()
    return int(counter.get_total_flops())


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], device: torch.device, clock: str = "wall") -> float:
    """Seconds one call of ``fn`` takes on ``clock`` (``CLOCKS``), device work included."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
    now = CLOCKS[clock]
    synchronize(device)
    start = now()
    fn()
    synchronize(device)
    return now() - start


def time_clocks(fn: Callable[[], Any], device: torch.device,
                clocks: Sequence[str]) -> tuple[float, ...]:
    """Seconds one call of ``fn`` takes on each of ``clocks`` (``CLOCKS``), read together."""
    bad = [c for c in clocks if c not in CLOCKS]
    if bad or not clocks:
        raise ValueError(f"clocks must be some of {', '.join(CLOCKS)}, got {list(clocks)}")
    nows = [CLOCKS[c] for c in clocks]
    synchronize(device)
    start = [now() for now in nows]
    fn()
    synchronize(device)
    return tuple(now() - s for now, s in zip(nows, start))


def time_rounds(calls: Sequence[Callable[[], Any]], threads: Sequence[int], rounds: int,
                device: torch.device) -> list[list[list[float]]]:
    """Seconds per call, thread counts interleaved: round r sets each count of ``threads`` in
    order (``torch.set_num_threads``) and at each count times every call of ``calls`` once, so
    every count and call sees the same drift of a shared machine. Returns
    ``times[i_thread][i_call][r]``; the caller's thread count is restored afterwards."""
    before = torch.get_num_threads()
    times: list[list[list[float]]] = [[[] for _ in calls] for _ in threads]
    try:
        for _ in range(rounds):
            for per_count, n in zip(times, threads):
                if n != torch.get_num_threads():
                    torch.set_num_threads(n)
                for sink, call in zip(per_count, calls):
                    sink.append(time_call(call, device))
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
    return times


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


def resident_bytes() -> int:
    """This process's resident set now (Linux ``VmRSS``), in bytes."""
    return _proc_status_kib("VmRSS") * 1024


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _set_malloc(accounting: bool) -> bool:
    """glibc: every block over 64 KiB its own mapping (accounting) or normal heap reuse (timing)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        if accounting:
            libc.malloc_trim(0)
            return (libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024) == 1
                    and libc.mallopt(_M_TRIM_THRESHOLD, 128 * 1024) == 1)
        return (libc.mallopt(_M_MMAP_THRESHOLD, 32 * 2**20) == 1
                and libc.mallopt(_M_TRIM_THRESHOLD, 64 * 2**20) == 1)
    except (OSError, AttributeError):
        return False


def prepare_cpu_memory_accounting() -> bool:
    """Returns True when CPU peak memory can be measured in this process (Linux, glibc); sets
    the allocator to its timing configuration (see the module notes). Idempotent."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _proc_status_kib("VmHWM")
    except OSError:
        return False
    return _set_malloc(accounting=False)


def saved_bytes(fn: Callable[[], Any]) -> int:
    """Bytes of the distinct storages autograd keeps for the backward pass of ``fn()``."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


class PeakMemory:
    """Context manager measuring the peak memory a block adds (bytes in ``.peak``; None when
    unavailable) and the high-water mark itself (``.high``: CUDA, all memory allocated at the
    peak; CPU, the resident set's). CUDA: allocator statistics; CPU: resident-set high-water
    mark."""

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.device = device
        self.enabled = enabled
        self.peak: int | None = None
        self.high: int | None = None

    def __enter__(self) -> PeakMemory:
        # No gc.collect() here: tensors are freed by reference counting, and a full collection
        # costs ~0.5 s per config once torch's compiler modules are loaded.
        if not self.enabled:
            return self
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            _set_malloc(accounting=True)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._base = _proc_status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        if self.device.type == "cuda":
            synchronize(self.device)
            high = torch.cuda.max_memory_allocated(self.device)
        else:
            high = _proc_status_kib("VmHWM") * 1024
            _set_malloc(accounting=False)
        if exc[0] is None:
            self.peak, self.high = max(0, high - self._base), high


def matmul_gflops(device: torch.device, dtype: torch.dtype,
                  sizes: tuple[int, ...] = (256, 512, 1024, 2048),
                  min_seconds: float = 0.2) -> tuple[float, int]:
    """The machine's best sustained square-matmul rate in GFLOP/s (2 n^3 FLOPs per product), and
    the size n that reached it. Each size: one warm-up product, then repeated products for at
    least ``min_seconds``; the best size's mean rate counts."""
    best, best_n = 0.0, sizes[0]
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        torch.mm(a, b)
        reps, elapsed = 0, 0.0
        synchronize(device)
        start = time.perf_counter()
        while elapsed < min_seconds:
            torch.mm(a, b)
            reps += 1
            synchronize(device)
            elapsed = time.perf_counter() - start
        rate = 2 * n**3 * reps / elapsed / 1e9
        if rate > best:
            best, best_n = rate, n
    return best, best_n
