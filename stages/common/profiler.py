"""The per-stage profiler: phase timings, throughput, peak memory, GIL contention, bottlenecks named in words.

What it is: an object a stage's loop drives (`with prof.phase("generation"): ...`, `prof.count(...)`)
that turns into namespaced metrics (`timing/`, `perf/`) and a Markdown report whose last section
names the bottleneck in plain words (what to try about it: bottleneck_advice, narrowed to the `facts` the
stage records). What it is not: a sampling profiler of Python frames (use
py-spy) or of kernels (use torch.profiler / Nsight); it says *which phase* to look into, not which op.

GIL contention is measured from the outside: a daemon thread sleeps `sample_interval_s` again and
again and records how late it wakes up. `time.sleep` releases the GIL, so the lateness is the time
the thread waited to get the GIL (and a CPU) back. On an idle Linux machine it oversleeps by about
0.05-0.2 ms (timer slack plus wake-up); when another thread runs pure Python, CPython makes the
waiter wait up to `sys.getswitchinterval()` (5 ms by default) before the holder must let go. So with
the default 5 ms interval, `mean lateness / interval` is roughly the share of time some thread was
running Python while holding the GIL (torch ops release the GIL while they run, so they do not
count). An oversubscribed machine (more busy threads than cores) inflates it too, and can push it
above 1. The sampler costs one GIL hand-off per wake-up (200 a second); on a pure-Python loop its
cost is within run-to-run noise.

Peak GPU memory per phase (once CUDA is initialised; on a CPU nothing is reported, not zeros): each
phase resets CUDA's peak counters when it starts and reads max_memory_allocated / max_memory_reserved
when it ends. A reset erases the peak of whatever was open around it, so the peaks are kept here
(_PeakMemory): before each reset the reading so far is folded into every open phase and the stage total,
and a phase's reading at its end into the phases around it too, so a phase nested in another never hides
the outer one's peak. Anything else in the process that reads CUDA's peak counters sees them reset at
each phase start.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import resource
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from alignflow.stages.common.bottleneck_advice import RunFacts, advice_for

# Lateness histogram: 20 log-spaced bins per decade from 1 us to 100 s. The p99 it reports is the
# upper edge of a bin, at most 12% (10**(1/20)) above the exact value, in a fixed 1.3 KB however long
# the stage runs (a 5 ms sampler takes 720k samples an hour; keeping them all would not be).
_BINS_PER_DECADE = 20
_N_BINS = 8 * _BINS_PER_DECADE

# Device utilisation is a driver counter averaged over its own sample period (1/6 s to 1 s), so reading
# it more often than every 0.5 s only repeats values.
_DEVICE_UTIL_PERIOD_S = 0.5

# ---------------------------------------------------------------------------------------------------
# Bottleneck thresholds (each with why)
# ---------------------------------------------------------------------------------------------------

# A phase is called "the" bottleneck at >= 40% of the wall time: by Amdahl's law making it free gives
# 1/(1 - 0.4) = 1.67x, while below that no single phase is worth more than the rest combined.
DOMINANT_PHASE_SHARE = 0.40
# Time outside every phase above 20% means the profile misses a big piece of the loop; wrap it.
UNTIMED_SHARE = 0.20
# 1 ms mean lateness per wake-up: 5-20x the idle floor (0.05-0.2 ms) and about 20% of the 5 ms switch
# interval, i.e. some thread runs Python holding the GIL about a fifth of the time.
GIL_DELAY_MS = 1.0
# Peak RSS at 85% of the machine's RAM leaves too little for page cache and other processes: the next
# bigger batch or checkpoint load is where the OOM killer strikes.
HOST_MEMORY_SHARE = 0.85
# Peak allocated device memory at 90% of the device: the caching allocator's fragmentation (often 5-10%)
# turns that into out-of-memory errors on a slightly longer batch.
DEVICE_MEMORY_SHARE = 0.90
# Mean device utilisation below 40% while the stage ran (needs >= 10 readings, i.e. 5 s): the GPU
# waits on the host most of the time.
DEVICE_UTIL_LOW = 40.0
DEVICE_UTIL_MIN_READINGS = 10

# ---------------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------------


def peak_rss_mb() -> float:
    """Peak resident memory of this process since it started, in MiB (ru_maxrss:
    KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def machine_memory_mb() -> float | None:
    """Total RAM of the machine in MiB (psutil), or None when psutil is missing."""
    try:
        import psutil
    except ImportError:
        return None
    return psutil.virtual_memory().total / 2**20


def _torch_cuda():
    """torch.cuda when torch is already imported and CUDA is initialised; never imports torch itself."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    cuda = torch.cuda
    try:
        if cuda.is_available() and cuda.is_initialized():
            return cuda
    except Exception:  # a broken driver must not break the stage being profiled
        return None
    return None


def _synchronize() -> None:
    cuda = _torch_cuda()
    if cuda is not None:
        cuda.synchronize()


_MIB = 2**20


class _PeakMemory:
    """Peak allocated and reserved CUDA bytes per phase and over the stage, across nested phases (module
    docstring).

    Only touches CUDA once it is initialised; `seen` says whether any reading was taken (False on a CPU)."""

    def __init__(self) -> None:
        self._open: list[list[int]] = []  # [allocated, reserved] peaks of the open phases, innermost last
        self.phases: dict[str, tuple[int, int]] = {}  # phase -> its peaks over every call
        self.total = [0, 0]
        self.seen = False

    def _fold(self, cuda: Any, into: list[list[int]]) -> None:
        """Fold the peaks since the last reset into `into`, every open phase and the stage total."""
        reading = (int(cuda.max_memory_allocated()), int(cuda.max_memory_reserved()))
        self.seen = True
        for frame in (*into, *self._open, self.total):
            frame[0], frame[1] = max(frame[0], reading[0]), max(frame[1], reading[1])

    def enter(self) -> list[int]:
        """A phase starts: returns its frame, to hand to exit()."""
        cuda = _torch_cuda()
        if cuda is not None:
            self._fold(cuda, [])  # what the open phases reached before the reset below erases it
            cuda.reset_peak_memory_stats()
        frame = [0, 0]
        self._open.append(frame)
        return frame

    def exit(self, name: str, frame: list[int]) -> None:
        # By identity, not the innermost: a phase timed on another thread may end out of order.
        self._open[:] = [f for f in self._open if f is not frame]
        cuda = _torch_cuda()
        if cuda is None:
            return
        self._fold(cuda, [frame])
        allocated, reserved = self.phases.get(name, (0, 0))
        self.phases[name] = (max(allocated, frame[0]), max(reserved, frame[1]))

    def stage_peaks(self) -> tuple[int, int] | None:
        """(allocated, reserved) peak bytes of the whole stage so far, or None before CUDA was initialised."""
        cuda = _torch_cuda()
        if cuda is not None:
            self._fold(cuda, [])
        return (self.total[0], self.total[1]) if self.seen else None


class _LatenessStats:
    """Running mean/max and a log histogram of sampler lateness (seconds), whole run and current window.

    Written by the sampler thread only; read by the main thread (single writer, so no lost updates).
    """

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.max = 0.0
        self.hist = [0] * _N_BINS
        self.window_count = 0
        self.window_total = 0.0

    def add(self, late_s: float) -> None:
        late_s = max(late_s, 0.0)
        self.count += 1
        self.total += late_s
        self.max = max(self.max, late_s)
        self.window_count += 1
        self.window_total += late_s
        us = late_s * 1e6
        index = 0 if us <= 1.0 else min(_N_BINS - 1, int(math.log10(us) * _BINS_PER_DECADE))
        self.hist[index] += 1

    def quantile(self, q: float) -> float:
        """Upper bin edge (seconds) under which a share `q` of the samples lie (0 with no samples)."""
        if self.count == 0:
            return 0.0
        need = q * self.count
        seen = 0
        counts = list(self.hist)  # a snapshot: the sampler may add while we walk
        for index, n in enumerate(counts):
            seen += n
            if seen >= need:
                return min(10 ** ((index + 1) / _BINS_PER_DECADE) / 1e6, self.max)
        return self.max

    def take_window(self) -> tuple[int, float]:
        count, total = self.window_count, self.window_total
        self.window_count, self.window_total = 0, 0.0
        return count, total


# ---------------------------------------------------------------------------------------------------
# The rules
# ---------------------------------------------------------------------------------------------------


@dataclass
class ProfileSnapshot:
    """Everything the bottleneck rules read; None where a measurement is unavailable (no sampler, no CUDA)."""

    phase_totals: dict[str, float]
    wall_s: float
    gil_delay_ms_mean: float | None = None
    gil_contention: float | None = None
    peak_rss_mb: float | None = None
    machine_memory_mb: float | None = None
    peak_device_mem_mb: float | None = None  # allocated (the tensors'), the stage's peak
    peak_device_reserved_mb: float | None = None  # reserved by the caching allocator, the stage's peak
    # (allocated, reserved)
    phase_peak_device_mb: dict[str, tuple[float, float]] = field(default_factory=dict)
    device_mem_total_mb: float | None = None
    device_util: float | None = None
    device_util_readings: int = 0
    iteration_word: str = "each iteration"
    facts: RunFacts = field(default_factory=RunFacts)  # what the run runs with: narrows the advice
    extra: dict[str, Any] = field(default_factory=dict)


def bottleneck_rules(s: ProfileSnapshot) -> list[str]:
    """Plain-word findings, most important first (thresholds and their reasons are the module constants)."""
    found: list[str] = []
    timed = sum(s.phase_totals.values())
    if s.phase_totals and s.wall_s > 0:
        name, seconds = max(s.phase_totals.items(), key=lambda kv: kv[1])
        share = seconds / s.wall_s
        if share >= DOMINANT_PHASE_SHARE:
            found.append(f"{name} is {share:.0%} of {s.iteration_word}: {advice_for(name, s.facts)}")
        else:
            found.append(
                f"no single phase dominates: the largest, {name}, is {share:.0%} of the wall time, so "
                "speeding up any one phase gains little; raise batch sizes to cut per-call overhead"
            )
        untimed = (s.wall_s - timed) / s.wall_s
        if untimed >= UNTIMED_SHARE:
            found.append(
                f"{untimed:.0%} of the wall time is in no timed phase: wrap the rest of the loop in "
                "phases (data loading, logging and Python glue are the usual suspects)"
            )
    if s.gil_delay_ms_mean is not None and s.gil_delay_ms_mean >= GIL_DELAY_MS:
        found.append(
            f"the Python thread waited {s.gil_delay_ms_mean:.2f} ms per wake-up on average (about 0.1 ms "
            f"when idle; GIL contention {s.gil_contention or 0:.2f}): CPU-bound Python in the loop holds "
            "the GIL (per-token Python loops, tokenisation, Python reward functions, a busy logging "
            "thread), or the CPUs are oversubscribed; vectorise it or move it to a subprocess"
        )
    if s.peak_rss_mb and s.machine_memory_mb and s.peak_rss_mb >= HOST_MEMORY_SHARE * s.machine_memory_mb:
        found.append(
            f"peak process memory {s.peak_rss_mb / 1024:.1f} GiB is "
            f"{s.peak_rss_mb / s.machine_memory_mb:.0%} of the machine's {s.machine_memory_mb / 1024:.1f} "
            "GiB: close to an out-of-memory kill; lower batch sizes, unload the engine between rollouts, or "
            "use a bigger machine"
        )
    if (
        s.peak_device_mem_mb
        and s.device_mem_total_mb
        and s.peak_device_mem_mb >= DEVICE_MEMORY_SHARE * s.device_mem_total_mb
    ):
        found.append(
            f"peak device memory {s.peak_device_mem_mb / 1024:.1f} GiB is "
            f"{s.peak_device_mem_mb / s.device_mem_total_mb:.0%} of the device: one longer batch from "
            "out of memory; lower micro-batch sizes, use a higher ZeRO stage or activation checkpointing"
        )
    if (
        s.device_util is not None
        and s.device_util_readings >= DEVICE_UTIL_MIN_READINGS
        and s.device_util < DEVICE_UTIL_LOW
    ):
        found.append(
            f"the GPU was busy {s.device_util:.0f}% of the time: the loop is host-bound (Python, "
            "host-device copies, synchronisation); larger batches and CUDA graphs help"
        )
    return found


# ---------------------------------------------------------------------------------------------------
# The profiler
# ---------------------------------------------------------------------------------------------------


class Profiler:
    """Times phases, counts tokens/samples, samples GIL lateness, and reports metrics and bottlenecks.

    Phases are meant to be disjoint (not nested): shares are of the wall time from `start()` (or the first
    phase) to `stop()` (or now; a phase that ends after stop() moves the end to it). Use from the stage's
    main thread; the sampler thread is a daemon.
    """

    def __init__(
        self, stage: str, sample_interval_s: float = 0.005, *, iteration_word: str = "each iteration"
    ):
        if not sample_interval_s > 0:
            raise ValueError(f"sample_interval_s must be > 0, got {sample_interval_s}")
        self.stage = stage
        self.iteration_word = iteration_word  # how findings name the timed span ("the evaluation")
        self.facts = RunFacts()  # the stage fills in what it runs with (bottleneck_advice)
        self.sample_interval_s = float(sample_interval_s)
        self._totals: dict[str, float] = {}
        self._calls: dict[str, int] = {}
        self._window: dict[str, float] = {}
        self.tokens = 0
        self.samples = 0
        self._t0: float | None = None
        self._t_end: float | None = None
        self._window_start: float | None = None
        self._lateness = _LatenessStats()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._util_readings: list[float] = []
        self._memory = _PeakMemory()

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> Profiler:
        """Start the wall clock (if no phase has yet) and the GIL-contention sampler thread."""
        now = time.perf_counter()
        if self._t0 is None:
            self._t0 = self._window_start = now
        self._t_end = None
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, name=f"profiler-{self.stage}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the sampler thread and the wall clock (summary and report use the time up to here)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5 * self.sample_interval_s + 1.0)
            self._thread = None
        if self._t0 is not None and self._t_end is None:
            self._t_end = time.perf_counter()

    def __enter__(self) -> Profiler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _sample(self) -> None:
        interval = self.sample_interval_s
        cuda = None
        read_util = importlib.util.find_spec("pynvml") is not None
        next_util = time.perf_counter()
        while not self._stop.is_set():
            before = time.perf_counter()
            time.sleep(interval)
            after = time.perf_counter()
            self._lateness.add(after - before - interval)
            if read_util and after >= next_util:
                next_util = after + _DEVICE_UTIL_PERIOD_S
                cuda = cuda or _torch_cuda()
                if cuda is not None:
                    try:
                        self._util_readings.append(float(cuda.utilization()))
                    except Exception:  # pynvml present but unusable (no NVML): stop asking
                        read_util = False

    # -- recording -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase `name` (accumulated per name); waits for queued CUDA work at both ends."""
        _synchronize()
        memory = self._memory.enter()
        start = time.perf_counter()
        if self._t0 is None:
            self._t0 = self._window_start = start
        try:
            yield
        finally:
            _synchronize()
            end = time.perf_counter()
            self._memory.exit(name, memory)
            elapsed = end - start
            if self._t_end is not None:  # a phase after stop() (e.g. publishing) extends the wall clock
                self._t_end = max(self._t_end, end)
            self._add(name, elapsed)

    def _add(self, name: str, seconds: float) -> None:
        self._totals[name] = self._totals.get(name, 0.0) + seconds
        self._calls[name] = self._calls.get(name, 0) + 1
        self._window[name] = self._window.get(name, 0.0) + seconds

    def record_before_start(self, name: str, seconds: float) -> None:
        """Add phase `name` that ran before the wall clock started (e.g. the process start and imports before
        the stage could time anything): the wall clock is moved back by `seconds`."""
        if seconds < 0:
            raise ValueError(f"record_before_start() takes non-negative seconds, got {seconds}")
        if self._t0 is None:
            self._t0 = self._window_start = time.perf_counter()
        self._t0 -= seconds
        self._window_start = min(self._window_start, self._t0)
        self._add(name, seconds)

    def count(self, tokens: int = 0, samples: int = 0) -> None:
        """Add to the throughput counters (generated or trained tokens, and sequences)."""
        if tokens < 0 or samples < 0:
            raise ValueError(f"count() takes non-negative numbers, got tokens={tokens}, samples={samples}")
        self.tokens += int(tokens)
        self.samples += int(samples)

    # -- reading ---------------------------------------------------------------------------------

    @property
    def wall_s(self) -> float:
        """Seconds from start() (or the first phase) to stop() (or now)."""
        if self._t0 is None:
            return 0.0
        end = self._t_end if self._t_end is not None else time.perf_counter()
        return end - self._t0

    @property
    def phase_totals(self) -> dict[str, float]:
        return dict(self._totals)

    def iteration_metrics(self) -> dict[str, float]:
        """Per-iteration metrics since the previous call: 'timing/<phase>' seconds for every phase seen so
        far (0 when it did not run), 'timing/iteration' (wall seconds of the window) and, when the sampler
        runs, 'perf/gil_contention' over the window."""
        now = time.perf_counter()
        start = self._window_start if self._window_start is not None else now
        out = {f"timing/{name}": self._window.get(name, 0.0) for name in self._totals}
        out["timing/iteration"] = now - start
        count, total = self._lateness.take_window()
        if count:
            out["perf/gil_contention"] = total / count / self.sample_interval_s
        self._window = {}
        self._window_start = now
        return out

    def snapshot(self) -> ProfileSnapshot:
        """The numbers the rules and the report read."""
        s = ProfileSnapshot(
            phase_totals=self.phase_totals,
            wall_s=self.wall_s,
            peak_rss_mb=peak_rss_mb(),
            machine_memory_mb=machine_memory_mb(),
            iteration_word=self.iteration_word,
            facts=self.facts,
        )
        if self._lateness.count:
            mean = self._lateness.total / self._lateness.count
            s.gil_delay_ms_mean = mean * 1e3
            s.gil_contention = mean / self.sample_interval_s
            s.extra["gil_delay_ms_p99"] = self._lateness.quantile(0.99) * 1e3
            s.extra["gil_delay_ms_max"] = self._lateness.max * 1e3
            s.extra["gil_samples"] = self._lateness.count
        peaks = self._memory.stage_peaks()
        if peaks is not None:
            s.peak_device_mem_mb, s.peak_device_reserved_mb = peaks[0] / _MIB, peaks[1] / _MIB
            s.phase_peak_device_mb = {
                name: (a / _MIB, r / _MIB) for name, (a, r) in self._memory.phases.items()
            }
            cuda = _torch_cuda()
            if cuda is not None:
                s.device_mem_total_mb = cuda.get_device_properties(cuda.current_device()).total_memory / _MIB
        if self._util_readings:
            s.device_util = sum(self._util_readings) / len(self._util_readings)
            s.device_util_readings = len(self._util_readings)
        return s

    def summary(self) -> dict[str, float]:
        """Totals for the whole run: 'timing/<phase>_total', 'timing/wall_total', 'timing/untimed_total',
        'perf/tokens_per_s', 'perf/samples_per_s', 'perf/peak_rss_mb'; with the sampler
        'perf/gil_delay_ms_mean', 'perf/gil_delay_ms_p99', 'perf/gil_contention'; on CUDA the stage's
        'perf/peak_gpu_allocated_mb' and 'perf/peak_gpu_reserved_mb' (and 'perf/peak_device_mem_mb', the
        allocated one under its older name), each phase's 'perf/peak_gpu_allocated_mb/<phase>' and
        'perf/peak_gpu_reserved_mb/<phase>', and 'perf/device_util' (percent) when pynvml can read it."""
        s = self.snapshot()
        out = {f"timing/{name}_total": seconds for name, seconds in s.phase_totals.items()}
        wall = s.wall_s
        out["timing/wall_total"] = wall
        out["timing/untimed_total"] = max(wall - sum(s.phase_totals.values()), 0.0)
        out["perf/tokens_per_s"] = self.tokens / wall if wall > 0 else 0.0
        out["perf/samples_per_s"] = self.samples / wall if wall > 0 else 0.0
        out["perf/peak_rss_mb"] = s.peak_rss_mb or 0.0
        if s.gil_delay_ms_mean is not None:
            out["perf/gil_delay_ms_mean"] = s.gil_delay_ms_mean
            out["perf/gil_delay_ms_p99"] = s.extra["gil_delay_ms_p99"]
            out["perf/gil_contention"] = s.gil_contention
        if s.peak_device_mem_mb is not None:
            out["perf/peak_device_mem_mb"] = s.peak_device_mem_mb
            out["perf/peak_gpu_allocated_mb"] = s.peak_device_mem_mb
            out["perf/peak_gpu_reserved_mb"] = s.peak_device_reserved_mb or 0.0
            for name, (allocated, reserved) in s.phase_peak_device_mb.items():
                out[f"perf/peak_gpu_allocated_mb/{name}"] = allocated
                out[f"perf/peak_gpu_reserved_mb/{name}"] = reserved
        if s.device_util is not None:
            out["perf/device_util"] = s.device_util
        return out

    def bottlenecks(self) -> list[str]:
        """Plain-word findings from `bottleneck_rules` (the dominant phase first)."""
        return bottleneck_rules(self.snapshot())

    def report_markdown(self) -> str:
        """A Markdown report: phase table (seconds, calls, share), throughput, memory, GIL, bottlenecks."""
        s = self.snapshot()
        wall = s.wall_s
        gpu = s.peak_device_mem_mb is not None  # the GPU columns: only where CUDA was used
        lines = [
            f"# Profile: {self.stage}",
            "",
            f"Wall time {wall:.2f} s.",
            "",
            "## Phases",
            "",
            "| phase | calls | seconds | mean s/call | share |"
            + (" peak GPU allocated MiB | peak GPU reserved MiB |" if gpu else ""),
            "|---|---:|---:|---:|---:|" + ("---:|---:|" if gpu else ""),
        ]
        for name, seconds in sorted(s.phase_totals.items(), key=lambda kv: -kv[1]):
            calls = self._calls.get(name, 1)
            row = f"| {name} | {calls} | {seconds:.3f} | {seconds / calls:.4f} | {_share(seconds, wall)} |"
            if gpu:  # "-": the phase ended before CUDA was initialised (or only ran before the stage's clock)
                peaks = s.phase_peak_device_mb.get(name)
                row += f" {peaks[0]:.0f} | {peaks[1]:.0f} |" if peaks else " - | - |"
            lines.append(row)
        untimed = max(wall - sum(s.phase_totals.values()), 0.0)
        lines.append(f"| (untimed) | | {untimed:.3f} | | {_share(untimed, wall)} |" + (" | |" if gpu else ""))
        lines += [
            "",
            "## Throughput",
            "",
            "| | total | per second |",
            "|---|---:|---:|",
            f"| tokens | {self.tokens} | {self.tokens / wall if wall > 0 else 0.0:.1f} |",
            f"| samples | {self.samples} | {self.samples / wall if wall > 0 else 0.0:.2f} |",
            "",
            "## Memory",
            "",
        ]
        machine = f" of {s.machine_memory_mb / 1024:.1f} GiB" if s.machine_memory_mb else ""
        lines.append(f"- peak process memory (RSS): {s.peak_rss_mb or 0.0:.0f} MiB{machine}")
        if s.peak_device_mem_mb is not None:
            total = f" of {s.device_mem_total_mb / 1024:.1f} GiB" if s.device_mem_total_mb else ""
            lines.append(f"- peak device memory (allocated): {s.peak_device_mem_mb:.0f} MiB{total}")
            lines.append(
                f"- peak device memory (reserved by the caching allocator): "
                f"{s.peak_device_reserved_mb or 0.0:.0f} MiB{total}"
            )
        if s.device_util is not None:
            lines.append(
                f"- device utilisation: {s.device_util:.0f}% mean over {s.device_util_readings} readings"
            )
        lines += ["", "## GIL contention", ""]
        if s.gil_delay_ms_mean is None:
            lines.append("- not measured (the sampler thread was not started)")
        else:
            lines += [
                f"- sampler: sleeps {self.sample_interval_s * 1e3:.1f} ms, {s.extra['gil_samples']} wake-ups",
                f"- wake-up delay: mean {s.gil_delay_ms_mean:.3f} ms, p99 {s.extra['gil_delay_ms_p99']:.3f} "
                f"ms, max {s.extra['gil_delay_ms_max']:.3f} ms",
                f"- contention estimate (mean delay / interval): {s.gil_contention:.3f}",
            ]
        lines += ["", "## Bottlenecks", ""]
        findings = bottleneck_rules(s)
        lines += [f"- {f}" for f in findings] if findings else ["- nothing stands out"]
        return "\n".join(lines) + "\n"

    def write_report(self, path: str | Path) -> Path:
        """Write report_markdown() to `path` (e.g. <output>/profile.md); returns the path."""
        path = Path(path)
        path.write_text(self.report_markdown())
        return path


def _share(seconds: float, wall: float) -> str:
    return f"{seconds / wall:.0%}" if wall > 0 else "-"
