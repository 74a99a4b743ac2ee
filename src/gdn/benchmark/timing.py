"""Timing on the device (METHOD.md): medians of CUDA-event samples after a warm-up that is not counted, inputs rotated
over enough buffer sets that the L2 cache cannot hold them, CUDA-graph replay for launch-bound ops, and the two
ceilings (device-to-device copy bandwidth, bf16 matrix rate on random data).

A timed function takes the index of the buffer set to run on: ``fn(i)`` for ``i in range(n_sets)``.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

MIN_SAMPLE_MS = 0.5      # each sample spans at least this much device time (event resolution is ~0.5 us)
MAX_ROTATION_SETS = 128
NOISY_SPREAD = 0.10      # a measurement whose spread is above this is taken again (``retime_noisy``)
NOISY_RETRIES = 2


@dataclass
class Timing:
    median_ms: float          # per call
    p20_ms: float
    p80_ms: float
    samples: int
    calls_per_sample: int
    mode: str                 # "graph", "eager", "host" (+ a reason where a graph fell back to eager)
    host_ms: Optional[float] = None   # device_time only: the host's time to enqueue one call, the GPU idle

    @property
    def spread(self) -> float:
        """(p80 - p20) / median: the noise of this measurement."""
        return (self.p80_ms - self.p20_ms) / self.median_ms if self.median_ms > 0 else float("nan")


def retime_noisy(measure: Callable[[], "Timing"], retries: int = NOISY_RETRIES,
                 noisy: float = NOISY_SPREAD) -> "Timing":
    """``measure()``, taken again (at most ``retries`` more times) while the best one's spread is above ``noisy``;
    returns the least noisy, its mode saying how many were taken. A busy host or clocks still ramping up spoil the
    samples of one window (seen: the first row of a ``gdn bench`` run with every peer at 21-24% spread, 2-13% on the
    other rows; bench/NOTES.md)."""
    best = measure()
    taken = 1
    while best.spread > noisy and taken <= retries:
        t = measure()
        taken += 1
        if t.spread < best.spread:
            best = t
    if taken > 1:
        best.mode = f"{best.mode} (least noisy of {taken})"
    return best


def rotation_sets(bytes_per_set: float, l2_bytes: int, max_sets: int = MAX_ROTATION_SETS) -> int:
    """Buffer sets to rotate over so that one rotation touches at least twice the L2 cache."""
    if not bytes_per_set or bytes_per_set <= 0:
        return 1
    return int(max(1, min(max_sets, math.ceil(2 * l2_bytes / bytes_per_set))))


def _quantiles(per_call: List[float]):
    s = sorted(per_call)
    q = lambda f: s[min(len(s) - 1, max(0, int(round(f * (len(s) - 1)))))]  # noqa: E731
    return statistics.median(s), q(0.2), q(0.8)


def l2_bytes(device) -> int:
    try:
        return int(torch.cuda.get_device_properties(device).L2_cache_size)
    except Exception:  # pragma: no cover - old torch or no CUDA
        return 50 * 2 ** 20


class CudaTimer:
    """Times ``fn(i)`` with CUDA events. ``target_s``: device time spent on samples per measurement."""

    def __init__(self, device, target_s: float = 0.3, min_samples: int = 5, max_samples: int = 200):
        self.device = torch.device(device)
        self.target_ms = target_s * 1e3
        self.min_samples = min_samples
        self.max_samples = max_samples
        self._sleep_cycles_per_ms = None

    # -- helpers -------------------------------------------------------------------------------------------------------
    def _sync(self):
        torch.cuda.synchronize(self.device)

    def _event_ms(self, launch: Callable[[], None]) -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        launch()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)

    def _n_samples(self, sample_ms: float) -> int:
        return int(max(self.min_samples, min(self.max_samples, self.target_ms / max(sample_ms, 1e-3))))

    def _samples(self, launch: Callable[[], None], n: int, before: Callable[[], None] = None) -> List[float]:
        """``n`` event-timed runs of ``launch``, each preceded (outside its events) by ``before`` when given."""
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for a, b in evs:
            if before is not None:
                before()
            a.record()
            launch()
            b.record()
        self._sync()
        return [a.elapsed_time(b) for a, b in evs]

    # -- public --------------------------------------------------------------------------------------------------------
    def time(self, fn: Callable[[int], object], n_sets: int = 1, graph: bool = False) -> Timing:
        """Median per call of ``fn`` over its buffer sets (a graph replay where ``graph``), re-taken when noisy."""
        return retime_noisy(lambda: self._time_once(fn, n_sets, graph))

    def _time_once(self, fn, n_sets: int, graph: bool) -> Timing:
        if graph:
            try:
                return self._graph(fn, n_sets)
            except Exception as e:  # capture unsupported by this implementation: time it eagerly, and say so
                try:
                    self._sync()
                except Exception:
                    raise e
                t = self._eager(fn, n_sets)
                why = str(e).splitlines()[0][:120] if str(e) else ""
                t.mode = f"eager (graph capture failed: {type(e).__name__}: {why})"
                return t
        return self._eager(fn, n_sets)

    def _pass(self, fn, n_sets, passes=1):
        def launch():
            for _ in range(passes):
                for i in range(n_sets):
                    fn(i)
        return launch

    def _eager(self, fn, n_sets) -> Timing:
        self._pass(fn, n_sets)()                      # warm-up: compilation, autotuning, allocator, caches
        self._sync()
        ms_pass = self._event_ms(self._pass(fn, n_sets))
        passes = max(1, math.ceil(MIN_SAMPLE_MS / max(ms_pass, 1e-4)))
        calls = passes * n_sets
        raw = self._samples(self._pass(fn, n_sets, passes), self._n_samples(ms_pass * passes))
        med, p20, p80 = _quantiles([r / calls for r in raw])
        return Timing(med, p20, p80, len(raw), calls, "eager")

    def device_time(self, fn: Callable[[int], object], n_sets: int = 1) -> Timing:
        """Median device time per call of ``fn`` with the host kept ahead of the GPU: each sample is enqueued behind a
        ``torch.cuda._sleep`` that outlasts the host's enqueueing of it, so the gaps between its kernels are the
        GPU's own. An eager sample of a short call on a slow host times the host instead (bench/NOTES.md, sixteenth
        session: FlashInfer's TP2 prefill 0.24 ms eager, 0.19 on the device). Re-taken when noisy."""
        return retime_noisy(lambda: self._device_once(fn, n_sets))

    def _cycles_per_ms(self) -> float:
        if self._sleep_cycles_per_ms is None:
            cycles = 20_000_000
            torch.cuda._sleep(1000)
            self._sleep_cycles_per_ms = cycles / max(self._event_ms(lambda: torch.cuda._sleep(cycles)), 1e-3)
        return self._sleep_cycles_per_ms

    def _device_once(self, fn, n_sets) -> Timing:
        run = self._pass(fn, n_sets)
        run()                                          # warm-up
        self._sync()
        host = []
        for _ in range(2):                             # host time to enqueue one pass (the GPU idle: no back-pressure)
            t0 = time.perf_counter()
            run()
            host.append((time.perf_counter() - t0) * 1e3)
            self._sync()
        ms_pass = self._event_ms(run)
        passes = max(1, math.ceil(MIN_SAMPLE_MS / max(ms_pass, 1e-4)))
        ahead_ms = 1.5 * min(host) * passes + 0.05
        sleep = int(self._cycles_per_ms() * ahead_ms)
        raw = self._samples(self._pass(fn, n_sets, passes), self._n_samples(ms_pass * passes + ahead_ms),
                            before=lambda: torch.cuda._sleep(sleep))
        calls = passes * n_sets
        med, p20, p80 = _quantiles([r / calls for r in raw])
        return Timing(med, p20, p80, len(raw), calls, "device", host_ms=min(host) / n_sets)

    def _graph(self, fn, n_sets) -> Timing:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):                 # eager warm-up off the default stream, as capture wants
            self._pass(fn, n_sets)()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._sync()
        ms_pass = self._event_ms(self._pass(fn, n_sets))
        reps = int(max(1, min(64, math.ceil(MIN_SAMPLE_MS / max(ms_pass, 1e-4)))))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self._pass(fn, n_sets, reps)()
        try:
            g.replay()                                # first replay uploads the graph
            self._sync()
            calls = reps * n_sets
            replay_ms = self._event_ms(g.replay)
            raw = self._samples(g.replay, self._n_samples(replay_ms))
            med, p20, p80 = _quantiles([r / calls for r in raw])
            return Timing(med, p20, p80, len(raw), calls, "graph")
        finally:
            del g


class HostTimer:
    """Wall-clock stand-in with the same interface (CPU tests of the benchmark itself; never for real numbers)."""

    def __init__(self, target_s: float = 0.01, min_samples: int = 3, max_samples: int = 20):
        self.target_s, self.min_samples, self.max_samples = target_s, min_samples, max_samples

    def time(self, fn, n_sets: int = 1, graph: bool = False) -> Timing:
        for i in range(n_sets):
            fn(i)
        raw = []
        t_end = time.perf_counter() + self.target_s
        while len(raw) < self.min_samples or (time.perf_counter() < t_end and len(raw) < self.max_samples):
            t0 = time.perf_counter()
            for i in range(n_sets):
                fn(i)
            raw.append((time.perf_counter() - t0) * 1e3 / n_sets)
        med, p20, p80 = _quantiles(raw)
        return Timing(med, p20, p80, len(raw), n_sets, "host")

    def device_time(self, fn, n_sets: int = 1) -> Timing:
        return self.time(fn, n_sets)


# ----------------------------------------------------------------------------------------------------------------------
# the two ceilings
# ----------------------------------------------------------------------------------------------------------------------
def measure_copy_GBps(device, nbytes: int = 1 << 30, timer: CudaTimer = None) -> float:
    """Device-to-device copy of ``nbytes`` (random data), counting bytes read plus bytes written."""
    n = nbytes // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    t = (timer or CudaTimer(device, target_s=0.2, min_samples=10)).time(lambda i: dst.copy_(src))
    del src, dst
    return 2 * n * 4 / (t.median_ms * 1e-3) / 1e9


def measure_matmul_TFLOPs(device, n: int = 8192, timer: CudaTimer = None) -> float:
    """bf16 ``n x n x n`` matrix product on random data (zeros run faster and would flatter the ceiling)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    t = (timer or CudaTimer(device, target_s=0.2, min_samples=10)).time(lambda i: torch.mm(a, b, out=c))
    del a, b, c
    return 2.0 * n ** 3 / (t.median_ms * 1e-3) / 1e12


__all__ = ["Timing", "CudaTimer", "HostTimer", "rotation_sets", "l2_bytes", "measure_copy_GBps",
           "measure_matmul_TFLOPs"]
