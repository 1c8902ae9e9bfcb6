"""The profiler: phases accumulate, the rules name the dominant phase and its share, GIL contention shows."""

from __future__ import annotations

import random
import threading
import time

import pytest

from alignflow.stages.common.bottleneck_advice import RunFacts
from alignflow.stages.common.profiler import (
    _BINS_PER_DECADE,
    Profiler,
    ProfileSnapshot,
    _LatenessStats,
    bottleneck_rules,
)

# time.sleep never returns early, so lower bounds are exact; upper bounds allow 60 ms per phase of
# scheduling delay because these tests share 2 cores with other jobs (still far below the next sleep).
SLACK_S = 0.06


def test_phases_accumulate_per_name_and_count_calls():
    prof = Profiler("test")
    for _ in range(2):
        with prof.phase("a"):
            time.sleep(0.05)
    with prof.phase("b"):
        time.sleep(0.02)
    totals = prof.phase_totals
    assert set(totals) == {"a", "b"}
    assert 0.10 <= totals["a"] <= 0.10 + 2 * SLACK_S
    assert 0.02 <= totals["b"] <= 0.02 + SLACK_S
    assert prof._calls == {"a": 2, "b": 1}
    summary = prof.summary()
    assert summary["timing/a_total"] == totals["a"]
    assert summary["timing/wall_total"] >= totals["a"] + totals["b"]


def test_phase_is_recorded_when_the_block_raises():
    prof = Profiler("test")
    with pytest.raises(RuntimeError), prof.phase("boom"):
        time.sleep(0.01)
        raise RuntimeError("x")
    assert prof.phase_totals["boom"] >= 0.01


def test_iteration_metrics_cover_only_the_window_since_the_last_call():
    prof = Profiler("test")
    prof.start()
    with prof.phase("generation"):
        time.sleep(0.04)
    first = prof.iteration_metrics()
    with prof.phase("training"):
        time.sleep(0.03)
    second = prof.iteration_metrics()
    prof.stop()
    assert 0.04 <= first["timing/generation"] <= 0.04 + SLACK_S
    assert "timing/training" not in first
    assert second["timing/generation"] == 0.0  # every phase seen so far appears, so curves stay continuous
    assert 0.03 <= second["timing/training"] <= 0.03 + SLACK_S
    assert second["timing/iteration"] >= second["timing/training"]
    assert first["timing/iteration"] >= first["timing/generation"]
    assert prof.phase_totals["generation"] == first["timing/generation"]  # totals keep accumulating


def test_throughput_counters_divide_by_the_wall_time():
    prof = Profiler("test")
    prof.start()
    prof.count(tokens=300, samples=3)
    prof.count(tokens=100)
    time.sleep(0.02)
    prof.stop()
    summary = prof.summary()
    wall = prof.wall_s
    assert summary["perf/tokens_per_s"] == pytest.approx(400 / wall, rel=1e-12)
    assert summary["perf/samples_per_s"] == pytest.approx(3 / wall, rel=1e-12)
    assert summary["perf/peak_rss_mb"] > 10  # a Python process with pytest loaded holds tens of MiB
    assert "perf/peak_device_mem_mb" not in summary  # no CUDA here
    with pytest.raises(ValueError, match="non-negative"):
        prof.count(tokens=-1)


def test_the_rule_names_the_dominant_phase_with_its_share():
    rules = bottleneck_rules(ProfileSnapshot({"generation": 7.8, "training": 2.0, "refit": 0.2}, wall_s=10.0))
    assert rules[0] == (
        "generation is 78% of each iteration: try the native engine, larger rollout batches "
        "(engine.max_batch_size) or CUDA graphs on GPU"
    )
    assert len(rules) == 1  # nothing else crosses a threshold


def test_the_rule_on_a_real_profile_quotes_the_measured_share():
    prof = Profiler("test")
    prof.start()
    with prof.phase("training"):
        time.sleep(0.15)
    with prof.phase("refit"):
        time.sleep(0.02)
    prof.stop()
    share = prof.phase_totals["training"] / prof.wall_s
    assert share > 0.5
    first = prof.bottlenecks()[0]
    assert first.startswith(f"training is {share:.0%} of each iteration: try larger minibatches")
    assert "ZeRO stage" in first


def test_the_rule_narrows_its_advice_to_the_runs_facts():
    facts = RunFacts(train_device="cpu", train_dtype="float32", bf16_arithmetic=False, zero_stage=0,
                     minibatches=1)
    rules = bottleneck_rules(ProfileSnapshot({"train": 6.6, "generate": 2.7}, wall_s=10.0, facts=facts))
    assert rules[0].startswith("train is 66% of each iteration: the usual knobs are in place")
    assert "bf16" not in rules[0].replace("without bf16 arithmetic", "")


def test_spread_out_time_and_untimed_time_are_reported():
    rules = bottleneck_rules(ProfileSnapshot({"a": 3.0, "b": 3.0, "c": 1.0}, wall_s=10.0))
    assert rules[0].startswith("no single phase dominates: the largest, a, is 30%")
    assert rules[1].startswith("30% of the wall time is in no timed phase")


def test_gil_and_memory_rules_fire_only_above_their_thresholds():
    quiet = ProfileSnapshot(
        {"x": 1.0},
        wall_s=1.0,
        gil_delay_ms_mean=0.2,
        gil_contention=0.04,
        peak_rss_mb=500.0,
        machine_memory_mb=1000.0,
    )
    assert len(bottleneck_rules(quiet)) == 1  # only the phase sentence
    busy = ProfileSnapshot(
        {"x": 1.0},
        wall_s=1.0,
        gil_delay_ms_mean=3.5,
        gil_contention=0.7,
        peak_rss_mb=900.0,
        machine_memory_mb=1000.0,
        peak_device_mem_mb=75_000.0,
        device_mem_total_mb=80_000.0,
        device_util=20.0,
        device_util_readings=30,
    )
    rules = bottleneck_rules(busy)
    assert rules[1].startswith("the Python thread waited 3.50 ms per wake-up on average")
    assert "GIL contention 0.70" in rules[1]
    assert rules[2].startswith("peak process memory 0.9 GiB is 90% of the machine's 1.0 GiB")
    assert rules[3].startswith("peak device memory 73.2 GiB is 94% of the device")
    assert rules[4].startswith("the GPU was busy 20% of the time")


def _contention_over(seconds: float, busy: bool) -> float:
    stop = threading.Event()

    def spin() -> None:  # pure Python: holds the GIL until the interpreter forces a switch
        x = 0
        while not stop.is_set():
            x += 1

    spinner = threading.Thread(target=spin, daemon=True)
    prof = Profiler("gil", sample_interval_s=0.005)
    if busy:
        spinner.start()
    prof.start()
    time.sleep(seconds)
    prof.stop()
    stop.set()
    if busy:
        spinner.join()
    return prof.summary()["perf/gil_contention"]


def test_gil_contention_rises_when_a_python_thread_spins():
    idle = _contention_over(0.4, busy=False)
    busy = _contention_over(0.4, busy=True)
    # A spinning thread makes every wake-up wait up to the 5 ms switch interval, while idle wake-ups are
    # late by timer slack only; 2x is far below the usual ratio (>10x) but still fails if nothing is measured.
    assert busy > 2 * idle, (idle, busy)


def test_lateness_p99_is_within_one_bin_of_the_exact_quantile():
    rng = random.Random(0)
    values = [rng.lognormvariate(-7.0, 1.0) for _ in range(5000)]  # ~1 ms median, heavy right tail
    stats = _LatenessStats()
    for v in values:
        stats.add(v)
    exact = sorted(values)[int(0.99 * len(values)) - 1]
    got = stats.quantile(0.99)
    bin_ratio = 10 ** (1 / _BINS_PER_DECADE)  # 1.122: the histogram's resolution
    assert exact <= got <= exact * bin_ratio
    assert stats.total / stats.count == pytest.approx(sum(values) / len(values), rel=1e-12)


def test_markdown_report_has_the_phase_table_and_the_findings():
    prof = Profiler("ppo")
    with prof:
        with prof.phase("generation"):
            time.sleep(0.06)
        with prof.phase("training"):
            time.sleep(0.01)
        prof.count(tokens=64, samples=4)
    text = prof.report_markdown()
    assert text.startswith("# Profile: ppo\n")
    assert "| phase | calls | seconds | mean s/call | share |" in text
    rows = [line for line in text.splitlines() if line.startswith("| generation |")]
    assert len(rows) == 1 and rows[0].split("|")[2].strip() == "1"
    assert "| (untimed) |" in text
    assert "## Throughput" in text and "| tokens | 64 |" in text
    assert "## GIL contention" in text and "wake-up delay: mean" in text
    assert "## Bottlenecks" in text and "- generation is " in text


def test_a_phase_after_stop_extends_the_wall_clock():
    prof = Profiler("test")
    prof.start()
    with prof.phase("train"):
        time.sleep(0.01)
    prof.stop()
    with prof.phase("publish"):
        time.sleep(0.03)
    assert prof.wall_s >= sum(prof.phase_totals.values())
    assert prof.summary()["timing/untimed_total"] < 0.03  # publish is inside the wall time, not outside it


def test_a_phase_recorded_before_start_moves_the_wall_clock_back():
    prof = Profiler("test").start()
    prof.record_before_start("process_start", 2.0)
    with prof.phase("setup"):
        time.sleep(0.02)
    prof.stop()
    assert prof.phase_totals["process_start"] == 2.0
    assert 2.02 <= prof.wall_s <= 2.02 + SLACK_S
    assert prof.iteration_metrics()["timing/process_start"] == 2.0
    assert "| process_start | 1 | 2.000 |" in prof.report_markdown()
    with pytest.raises(ValueError, match="non-negative"):
        prof.record_before_start("x", -1.0)


class FakeCudaMemory:
    """torch.cuda's memory counters as the profiler reads them: bytes allocated now, bytes the caching
    allocator reserves (it keeps what was freed until empty_cache), and the peaks of both since the last
    reset."""

    MIB = 2**20

    def __init__(self, base_mib: int):
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = base_mib * self.MIB
        self.resets = 0

    def alloc(self, mib: int) -> None:
        self.allocated += mib * self.MIB
        self.reserved = max(self.reserved, self.allocated)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, mib: int) -> None:
        self.allocated -= mib * self.MIB

    def empty_cache(self) -> None:
        self.reserved = self.allocated

    def max_memory_allocated(self) -> int:
        return self.peak_allocated

    def max_memory_reserved(self) -> int:
        return self.peak_reserved

    def reset_peak_memory_stats(self) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved
        self.resets += 1

    def synchronize(self) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def get_device_properties(self, index: int):
        return type("Properties", (), {"total_memory": 80 * 1024 * self.MIB})()


def test_peak_gpu_memory_per_phase_survives_a_nested_phase(monkeypatch):
    """A phase resets CUDA's peak counters when it starts, which would erase the peak of the phase around it:
    the outer phase's 1600 MiB spike came before the inner phase started and must still be its peak."""
    from alignflow.stages.common import profiler as profiler_module

    cuda = FakeCudaMemory(base_mib=1000)
    monkeypatch.setattr(profiler_module, "_torch_cuda", lambda: cuda)
    prof = Profiler("ppo")
    with prof.phase("train"):
        cuda.alloc(600)  # activations of the forward pass
        cuda.free(500)
        with prof.phase("refit"):  # nested: 1100 + 50
            cuda.alloc(50)
            cuda.free(50)
        cuda.alloc(10)
    cuda.free(110)
    cuda.empty_cache()  # reserved back to 1000
    with prof.phase("generate"):
        cuda.alloc(200)
        cuda.free(200)
    with prof.phase("generate"):  # a second call: the phase keeps the larger peak of its calls
        cuda.alloc(100)
        cuda.free(100)
    cuda.alloc(2000)  # outside every phase: the stage's peak, no phase's
    cuda.free(2000)
    summary = prof.summary()
    assert cuda.resets == 4
    peaks = {k: v for k, v in summary.items() if k.startswith("perf/peak_gpu")}
    assert peaks == {
        "perf/peak_gpu_allocated_mb": 3000.0,
        "perf/peak_gpu_reserved_mb": 3000.0,
        "perf/peak_gpu_allocated_mb/train": 1600.0,
        "perf/peak_gpu_reserved_mb/train": 1600.0,
        "perf/peak_gpu_allocated_mb/refit": 1150.0,
        "perf/peak_gpu_reserved_mb/refit": 1600.0,
        "perf/peak_gpu_allocated_mb/generate": 1200.0,
        "perf/peak_gpu_reserved_mb/generate": 1200.0,
    }
    assert summary["perf/peak_device_mem_mb"] == 3000.0
    text = prof.report_markdown()
    assert (
        "| phase | calls | seconds | mean s/call | share | peak GPU allocated MiB | peak GPU reserved MiB |"
        in text
    )
    assert [line.split("|")[-3:-1] for line in text.splitlines() if line.startswith("| train |")] == [
        [" 1600 ", " 1600 "]
    ]
    assert "- peak device memory (reserved by the caching allocator): 3000 MiB of 80.0 GiB" in text


def test_a_phase_that_began_before_cuda_was_initialised_gets_its_peak_at_the_end(monkeypatch):
    from alignflow.stages.common import profiler as profiler_module

    cuda, ready = FakeCudaMemory(base_mib=0), []
    monkeypatch.setattr(profiler_module, "_torch_cuda", lambda: cuda if ready else None)
    prof = Profiler("sft")
    with prof.phase("load"):
        ready.append(True)  # the model moves to the GPU
        cuda.alloc(300)
    summary = prof.summary()
    assert summary["perf/peak_gpu_allocated_mb/load"] == summary["perf/peak_gpu_allocated_mb"] == 300.0


def test_no_gpu_memory_is_reported_without_cuda():
    prof = Profiler("test")
    with prof.phase("train"):
        time.sleep(0.001)
    assert not [k for k in prof.summary() if "gpu" in k or "device_mem" in k]  # no fake zeros on a CPU
    text = prof.report_markdown()
    assert "GPU" not in text and "| phase | calls | seconds | mean s/call | share |\n" in text
