"""Benchmark scripts run end to end with well-formed output; the roofline's byte and flop counts are exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], capture_output=True,
                          text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.heavy
def test_sampler_bench_reports_every_impl():
    from alignflow.kernels._triton_dispatch import cpp_available

    rows = json.loads(
        _run("sampler_bench.py", "--batch-sizes", "3", "--vocabs", "1000", "--repeats", "1", "--json")
    )
    assert {r["mode"] for r in rows} == {"plain", "top_p 0.9", "top_k 50", "top_k 50, top_p 0.9"}
    assert all(r["torch_ms"] > 0 and r["chunked_ms"] > 0 for r in rows)
    assert all((r.get("cpp_ms", 0) > 0) == cpp_available() for r in rows)
    assert [r["compiled_ms"] > 0 for r in rows if r["mode"] == "plain"] == [True]
    # Truncating modes also time the thresholds by sort and by prefix (the script checks they agree).
    assert all(
        r["sort_thresholds_ms"] > 0 and r["prefix_thresholds_ms"] > 0 for r in rows if r["mode"] != "plain"
    )


def test_engine_throughput_reports_every_engine_and_refit():
    result = json.loads(
        _run(
            "engine_throughput.py",
            "--models",
            "tiny",
            "--batch-sizes",
            "2",
            "--new-tokens",
            "4",
            "--repeats",
            "1",
            "--no-compile",
            "--dtypes",
            "float32",
            "--top-k",
            "5",
            "--top-p",
            "0.9",
            "--json",
        )
    )
    assert (result["top_k"], result["top_p"]) == (5, 0.9)
    engines = {row["engine"] for row in result["throughput"]}
    from alignflow.kernels import decode_loop

    # "native step" (the torch step) and "native bf16w" (bf16 linear weights) beside "native" where the
    # engine's default is the C++ decode loop
    assert engines == {"native", "hf", "transformers"} | (
        {"native step", "native bf16w"} if decode_loop.available() else set()
    )
    assert all(
        row["tokens_per_s"] > 0 and row["speedup_vs_hf_fp32"] is not None for row in result["throughput"]
    )
    assert [(r["engine"], r["dtype"]) for r in result["refit"]] == [("native", "float32")]
    import torch

    assert result["machine"]["cpus"] == os.cpu_count() and result["machine"]["cpu"]
    assert result["machine"]["bf16_arithmetic"] == (
        torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    )


def test_cpu_roofline_counts_the_bytes_and_flops_of_a_real_model(monkeypatch):
    """The floor's byte and flop counts are those of the transformers model the benchmark builds."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from cpu_roofline import step_cost
    from engine_throughput import MODELS

    config = MODELS["tiny"]
    model = LlamaForCausalLM(LlamaConfig(**config))
    linear_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    kv_len, batch = 40, 3
    kv_bytes = 2 * config["num_hidden_layers"] * batch * kv_len * config["num_key_value_heads"] * head_dim * 2
    nbytes, flops = step_cost(config, batch, kv_len, "bfloat16")
    assert nbytes == linear_params * 2 + kv_bytes
    attention_flops = 4 * config["num_hidden_layers"] * kv_len * config["hidden_size"]
    assert flops == batch * (2 * linear_params + attention_flops)


def test_cpu_roofline_generate_floor_is_the_prefill_plus_every_decode_step(monkeypatch):
    """The floor of a generate call counts each real prompt token once and each row's growing cache."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from cpu_roofline import generate_floor_s, prefill_cost
    from engine_throughput import MODELS

    config = MODELS["tiny"]
    model = LlamaForCausalLM(LlamaConfig(**config))
    layers_params = sum(
        m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)
    )
    head_params = model.lm_head.weight.numel()
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    lens, new_tokens = [3, 7, 5], 4
    # Token by token: a token at position i (1-based) of its row attends to i keys (q.k and p.v: 4 flops per
    # key and hidden unit per layer); only each row's last prompt token and the decode tokens reach the head.
    prefill_flops = sum(2 * layers_params + 4 * layers * hidden * i for n in lens for i in range(1, n + 1))
    prefill_flops += 2 * head_params * len(lens)
    decode_flops = sum(
        2 * (layers_params + head_params) + 4 * layers * hidden * (n + t)
        for t in range(1, new_tokens)
        for n in lens
    )
    assert prefill_cost(config, lens, "float32")[1] == prefill_flops
    # Bandwidth so high that every pass is compute bound: the floor is then all flops at the peak rate.
    floor, prefill = generate_floor_s(
        config, lens, new_tokens, "float32", bandwidth_gbs=1e12, peak_gflops=1.0
    )
    assert prefill == pytest.approx(prefill_flops / 1e9, rel=1e-12)
    assert floor == pytest.approx((prefill_flops + decode_flops) / 1e9, rel=1e-12)
    # A machine with fast arithmetic and a 1 GB/s read: every pass costs its bytes. The prefill reads every
    # weight once and writes each prompt token's keys and values.
    kv_dim = config["num_key_value_heads"] * hidden // config["num_attention_heads"]
    prefill_bytes = (layers_params + head_params) * 4 + 2 * layers * sum(lens) * kv_dim * 4
    assert prefill_cost(config, lens, "float32")[0] == prefill_bytes
    _, prefill = generate_floor_s(config, lens, new_tokens, "float32", bandwidth_gbs=1.0, peak_gflops=1e12)
    assert prefill == pytest.approx(prefill_bytes / 1e9, rel=1e-12)


def test_cpu_roofline_reads_the_throughput_json(tmp_path):
    rows = [
        {"model": "llama-100m", "dtype": "float32", "batch": 8, "engine": engine, "tokens_per_s": tps}
        for engine, tps in (("hf", 100.0), ("native+compile", 150.0))
    ]
    (tmp_path / "t.json").write_text(json.dumps({"throughput": rows}))
    result = json.loads(
        _run(
            "cpu_roofline.py",
            "--throughput-json",
            str(tmp_path / "t.json"),
            "--batch-sizes",
            "8",
            "--dtypes",
            "float32",
            "--repeats",
            "1",
            "--json",
        )
    )
    (row,) = result["rows"]
    assert result["read_bandwidth_gbs"] > 0 and result["gemm_gflops"]["float32"] > 0
    assert row["hf_tokens_per_s"] == 100.0 and row["native_tokens_per_s"] == 150.0
    assert row["max_speedup_vs_hf"] == row["floor_tokens_per_s"] / 100.0
    assert row["native_share_of_floor"] == pytest.approx(150.0 / row["floor_tokens_per_s"], rel=1e-12)


def test_kernels_bench_rl_times_the_reference_and_the_cpp_kernel():
    from alignflow.kernels._triton_dispatch import cpp_available

    rows = json.loads(_run("kernels_bench.py", "--rl", "--threads", "1", "--reps", "1", "--json"))
    impls = ("torch", "cpp") if cpp_available("selective_log_softmax") else ("torch",)
    assert [r["method"] for r in rows] == [
        f"{op}[{impl}]" for op in ("selective_log_softmax", "logprobs_and_entropy") for impl in impls
    ]
    assert all((r["B"], r["T"], r["V"], r["dtype"]) == (16, 31, 2048, "float32") for r in rows)
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in rows)


def test_cpu_roofline_refuses_a_batch_larger_than_its_prompt_set():
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "cpu_roofline.py"), "--batch-sizes", "8,128"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 2
    assert "--batch-sizes 128 exceeds --prompts-of-batch 64" in done.stderr


def test_cpu_kernels_bench_times_every_implementation_and_checks_them():
    """Every implementation is checked against F.linear and timed; where skinny_linear has no build its column
    is left out, and without AVX-512 the attention table, the others still run (the engine's packing floor on
    the RL benchmark model)."""
    from alignflow.kernels import _cpu_extension
    from alignflow.kernels import skinny_linear as skinny

    skinny_column, attention = skinny.available(), _cpu_extension.extension() is not None
    result = json.loads(
        _run(
            "cpu_kernels_bench.py",
            "--model",
            "tiny",
            "--rows",
            "3,9",
            "--attention-rows",
            "2,5",
            "--kv-len",
            "7",
            "--repeats",
            "1",
            "--json",
        )
    )
    assert [r["rows"] for r in result["linears"]] == [3, 9]
    names = ("onednn", "F.linear", "engine") + (("skinny",) if skinny_column else ())
    assert all(r[f"{k}_ms"] > 0 for r in result["linears"] for k in names)
    assert all(("skinny_ms" in r) is skinny_column for r in result["linears"])
    if attention:
        assert [r["rows"] for r in result["attention"]] == [2, 5]
        assert all(r[f"{k}_ms"] > 0 for r in result["attention"] for k in ("kernel", "torch", "compiled"))
    else:
        assert result["attention"] == []
    floor = json.loads(
        _run(
            "cpu_kernels_bench.py",
            "--model",
            "rl-4.7m",
            "--rows",
            "4",
            "--repeats",
            "1",
            "--engine-floor-kib",
            "1024",
            "--json",
        )
    )
    assert floor["model"] == "rl-4.7m" and floor["linears"][0]["engine_ms"] > 0


@pytest.mark.slow
@pytest.mark.heavy
def test_lora_vs_full_reports_both_stages_and_both_variants(tmp_path):
    """On the test-size model (2 PPO iterations): LoRA trains a small share and refits fewer bytes."""
    # no C++ build (minutes on a fresh machine): the table, not the engine
    small = [
        "model.tiny.hidden_size=32",
        "model.tiny.intermediate_size=64",
        "model.tiny.num_hidden_layers=1",
        "model.tiny.num_attention_heads=2",
        "model.tiny.num_key_value_heads=1",
        "model.tiny.vocab_size=320",
        "data.demo.n_sft=64",
        "data.demo.n_preferences=64",
        "data.demo.n_prompts=16",
        "data.demo.n_eval_prompts=8",
        "sft.batch_size=16",
        "sft.micro_batch_size=16",
        "ppo.iterations=2",
        "ppo.checkpoint_every=2",
        "ppo.prompts_per_iteration=8",
        "ppo.minibatch_size=8",
        "ppo.max_new_tokens=8",
        "engine.cpu_kernels=false",
    ]
    result = json.loads(
        _run(
            "lora_vs_full.py",
            "--rank",
            "2",
            "--workdir",
            str(tmp_path),
            "--json",
            *(arg for override in small for arg in ("--set", override)),
        )
    )
    rows = {(r["stage"], r["variant"]): r for r in result["rows"]}
    variants = ("full", "lora", "lora q,v")
    assert set(rows) == {(s, v) for s in ("sft", "ppo") for v in variants}
    for stage in ("sft", "ppo"):
        assert rows[stage, "full"]["trainable_share"] == 1.0
        assert 0 < rows[stage, "lora q,v"]["trainable_share"] < rows[stage, "lora"]["trainable_share"] < 0.2
        assert all(rows[stage, v]["peak_rss_mib"] > 100 and rows[stage, v]["seconds"] > 0 for v in variants)
    # q (32x32) and v (16x32) of the one layer in fp32: the refit sends exactly the adapted modules.
    assert rows["ppo", "lora q,v"]["refit_bytes"] == (32 * 32 + 16 * 32) * 4
    assert (
        rows["ppo", "lora q,v"]["refit_bytes"]
        < rows["ppo", "lora"]["refit_bytes"]
        < rows["ppo", "full"]["refit_bytes"]
    )


def test_rollout_balance_reports_queue_and_static_on_the_same_tokens():
    """Tiny model, 16 sequences, 2 workers: every schedule generates the same tokens, the static split gives
    each worker one part, and the grouped layout's static split is the unbalanced one (its long half on one
    worker)."""
    # The torch step: the C++ decode loop makes the tiny model's steps so cheap that the per-call costs, not
    # the lengths, decide each worker's time.
    result = json.loads(
        _run(
            "rollout_balance.py",
            "--model",
            "tiny",
            "--sequences",
            "16",
            "--batch",
            "4",
            "--chunk",
            "4",
            "--new-tokens",
            "16",
            "--repeats",
            "1",
            "--torch-step",
            "--json",
        )
    )
    rows = {(r["layout"], r["schedule"]): r for r in result["rows"]}
    assert set(rows) == {
        (layout, s) for layout in ("grouped", "shuffled") for s in ("static", "queue", "in-process")
    }
    assert all(
        r["same_tokens"] and r["tokens"] == rows["grouped", "static"]["tokens"] > 0 for r in rows.values()
    )
    assert rows["grouped", "static"]["one_part_each"] and rows["shuffled", "static"]["one_part_each"]
    assert rows["grouped", "queue"]["chunks_per_worker"] in ([2, 2], [1, 3], [3, 1])
    # The long half alone on one worker: it generates at least 3x longer than the other (about twice that on
    # 2 cores, so the bound has room).
    busy = rows["grouped", "static"]["busy_s"]
    assert max(busy) > 3 * min(busy) and rows["grouped", "static"]["imbalance"] > 1.4
    assert result["machine"]["cpus"] == os.cpu_count() and result["stop_tokens"] >= 1
    assert (
        result["refit"]["bytes_sent"] == 2 * result["refit"]["bytes"] > 0 and result["refit"]["seconds"] > 0
    )


@pytest.mark.slow
@pytest.mark.heavy  # tests/stages/common/test_ranks.py checks ZeRO-2 and ZeRO-3 ranks against one rank
def test_training_ranks_reports_every_variant_with_agreeing_losses(tmp_path):
    """The smallest model, 2 steps: the three variants train the same global batch, so their losses agree."""
    small = [
        "model.tiny.hidden_size=32",
        "model.tiny.intermediate_size=64",
        "model.tiny.num_hidden_layers=1",
        "model.tiny.num_attention_heads=2",
        "model.tiny.num_key_value_heads=1",
        "model.tiny.vocab_size=320",
        "data.demo.n_sft=64",
        "data.demo.n_preferences=64",
        "data.demo.n_prompts=16",
        "data.demo.n_eval_prompts=8",
        "sft.epochs=1",
    ]
    result = json.loads(
        _run(
            "training_ranks.py",
            "--repeats",
            "1",
            "--workdir",
            str(tmp_path),
            "--json",
            *(arg for override in small for arg in ("--set", override)),
        )
    )
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"1 rank", "2 ranks, ZeRO-2", "2 ranks, ZeRO-3"}
    assert all(r["seconds_per_step"] > 0 and r["tokens_per_s"] > 0 and r["steps"] >= 1 for r in rows.values())
    assert all(r["eval_loss"] == pytest.approx(rows["1 rank"]["eval_loss"], rel=1e-5) for r in rows.values())
    assert result["cores"] == os.cpu_count()


@pytest.mark.heavy  # tests/stages/common/test_two_nodes.py runs the two-node shapes
def test_rl_nodes_reports_one_node_and_two_namespaced_nodes(tmp_path):
    """The demo config at a tenth of its data, 2 iterations, two rows (trainer ranks on one node; a replica
    on the other node, or on this one with the reason where namespaces cannot be made): the same refit (the
    same model). tests/stages/common/test_two_nodes.py runs the two-node shapes."""
    from tests.stages.common import netns

    small = ["data.demo.n_sft=200", "data.demo.n_preferences=200", "data.demo.n_prompts=64",
             "data.demo.n_eval_prompts=8"]
    replica = "1 rank + replica on node B" if netns.why_not() is None else "1 rank + replica, 1 node"
    only = ["--only", "1 node x 2 ranks", "--only", replica]
    result = json.loads(_run("rl_nodes.py", "--repeats", "1", "--iterations", "2", "--workdir", str(tmp_path),
                             "--json", *only, *(arg for override in small for arg in ("--set", override))))
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"1 node x 2 ranks", replica} and result["two_nodes_left_out"] == netns.why_not()
    one = rows["1 node x 2 ranks"]
    for row in rows.values():
        assert row["timing/iteration"] > 0 and row["refit/seconds"] > 0
        assert row["refit/bytes_sent"] == one["refit/bytes_sent"] > 0


def test_training_forward_times_both_forwards_and_they_agree():
    result = json.loads(_run("training_forward.py", "--rounds", "1", "--models", "demo", "--json"))
    rows = {r["what"]: r for r in result["rows"]}
    assert set(rows) == {"train step", "no-grad forward"}
    assert all(r["plain_ms"] > 0 and r["lean_ms"] > 0 and r["cpu_ratio"] > 0 for r in rows.values())
    assert all(r["max_abs_diff"] < 1e-4 and r["tokens"] > 16 * 20 for r in rows.values())


def test_compaction_times_both_ways_on_every_layout_and_they_agree():
    result = json.loads(
        _run("compaction.py", "--rounds", "1", "--models", "demo", "--widths", "48", "--json")
    )
    rows = {r["layout"]: r for r in result["rows"]}
    assert set(rows) == {"packer's, slots", "packer's, tokens", "width 48"}
    assert all(r["every_slot_cpu_ms"] > 0 and r["real_tokens_cpu_ms"] > 0 for r in rows.values())
    assert all(r["max_abs_diff"] < 1e-4 for r in rows.values())
    # The same tokens either way; narrower rows hold more padding.
    assert rows["packer's, slots"]["tokens"] == rows["width 48"]["tokens"]
    assert rows["width 48"]["padding"] > rows["packer's, slots"]["padding"] >= 0


def test_packing_layouts_times_every_layout_and_they_agree_with_the_padded_forward():
    from alignflow.stages.common.training.packing import attention_width

    result = json.loads(_run("packing_layouts.py", "--rounds", "1", "--model", "bench", "--json"))
    rows = {(r["batch"], r["layout"]): r for r in result["rows"]}
    assert len(rows) == 6  # 2 batches x 3 layouts
    assert all(r["ms"] > 0 and r["max_abs_diff"] < 1e-4 for r in rows.values())
    # The GRPO batch's 4 prompts go in once each when shared: 3 copies of each fewer.
    grpo = {layout: r["tokens"] for (batch, layout), r in rows.items() if batch == "GRPO 4x4"}
    assert grpo[f"shared prompts, width {attention_width(256)}"] == grpo["separate, width 128"] - 3 * (
        24 + 30 + 33 + 36
    )


def rl_ladder():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import rl_ladder
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return rl_ladder


def test_rl_ladder_levels_add_to_the_ones_before():
    ladder = rl_ladder()
    engine, overrides = ladder.level_config("baseline")
    assert (
        engine == "hf"
        and overrides["old_logprobs"] == "recompute"
        and overrides["train_backend"] == "deepspeed"
    )
    assert (
        ladder.level_config("compiled")[0] == "native_compiled"
        and ladder.level_config("decode_loop")[0] == "native_loop"
    )
    engine, overrides = ladder.level_config("fast_step")
    assert engine == "native_loop"
    assert overrides == {
        "old_logprobs": "auto",
        "kl_metric": False,
        "fast_train_step": True,
        "autocast": "auto",
        "train_backend": "auto",
        "async_rollouts": False,
    }
    engine, bf16_overrides = ladder.level_config("bf16_weights")
    engines = sys.modules["rl_setup"].ENGINES  # loaded with the ladder
    assert bf16_overrides == overrides and engines[engine]["cpu_linear_weights"] == "bfloat16"
    assert ladder.level_config("async") == (engine, {**overrides, "async_rollouts": True})
    with pytest.raises(ValueError, match="unknown level 'fastest'; levels: baseline, native"):
        ladder.level_config("fastest")


def test_rl_ladder_takes_the_median_of_per_round_ratios_and_names_the_bounding_phase():
    """Ratios are taken round by round (a machine that drifts moves both runs of a round), then the median; a
    round whose TRL run was skipped gives no ratio, and the later rounds' TRL runs still meet their own
    round's baseline. The median of ratios differs from the ratio of medians here."""
    ladder = rl_ladder()

    def run(completions_per_s: float, train_s: float) -> dict:
        return {
            "iteration_s": 16 / completions_per_s,
            "completions_per_s": completions_per_s,
            "bottleneck": f"train {train_s}",
            "phases_s": {"train": train_s},
        }

    ours = {"baseline": [10.0, 20.0, 12.0], "fast_step": [30.0, 30.0, 60.0]}
    trl = [None, 15.0, 10.0]
    rounds = [
        {
            "levels": {("grpo", level): run(ours[level][i], 0.1 * i) for level in ours},
            "trl": {
                "grpo": {"median_s": 16 / t, "completions_per_s": t, "trl_version": "1.16.0"} if t else None
            },
        }
        for i, t in enumerate(trl)
    ]
    rows = {r["level"]: r for r in ladder.summarise(rounds, ["grpo"], ["baseline", "fast_step"])}
    assert set(rows) == {"baseline", "fast_step", "TRL 1.16.0"}
    fast = rows["fast_step"]
    assert fast["vs_trl_rounds"] == [2.0, 6.0] and fast["vs_trl"] == 4.0
    assert fast["speedup_vs_baseline"] == 3.0  # rounds 3.0, 1.5, 5.0
    assert fast["completions_per_s"] == 30.0 and fast["iteration_s"] == pytest.approx(16 / 30)
    assert fast["phases_s"] == {"train": 0.2}  # the last round's
    assert rows["TRL 1.16.0"]["completions_per_s"] == 12.5
    assert rows["TRL 1.16.0"]["speedup_vs_baseline"] == pytest.approx((15 / 20 + 10 / 12) / 2)
    iterations = [
        {"timing/iteration": 1.0, "timing/generate_engine": 0.9, "timing/generate": 0.2, "timing/train": 0.7}
    ] * 3
    unknown = ladder.bottleneck(iterations, {})
    assert unknown.startswith("train is 70% of each iteration: try larger minibatches")
    # narrowed by the run's facts (its alignflow_run.json's run_facts): nothing left to try but a profile
    facts = {"train_device": "cpu", "train_dtype": "float32", "bf16_arithmetic": False, "zero_stage": 0,
             "minibatches": 1}
    assert ladder.bottleneck(iterations, facts).startswith("train is 70% of each iteration: the usual knobs")


def test_rl_ladder_sets_each_round_against_its_own_gemm_peak():
    """The floor is the iteration's model FLOPs at the round's peak; x TRL at the floor is TRL's time over it,
    round by round (medians); a phase's share of the peak is its FLOPs over its time (generation over the
    engine's own time). Runs without FLOP counts give no such columns."""
    ladder = rl_ladder()

    def run(iteration_s: float, train_s: float) -> dict:
        return {"iteration_s": iteration_s, "completions_per_s": 16 / iteration_s, "bottleneck": "",
                "phases_s": {"train": train_s, "generate": 0.01, "generate_engine": 0.2},
                "phase_gflops": {"train": 12.0, "generate": 4.0}, "model_gflops": 16.0}

    rounds = [
        {"levels": {("grpo", "fast_step"): run(0.4, 0.2)}, "gemm_peak_gflops": 100.0,
         "trl": {"grpo": {"median_s": 1.2, "completions_per_s": 16 / 1.2}}},
        {"levels": {("grpo", "fast_step"): run(0.2, 0.1)}, "gemm_peak_gflops": 200.0,
         "trl": {"grpo": {"median_s": 0.8, "completions_per_s": 16 / 0.8}}},
    ]
    row = ladder.summarise(rounds, ["grpo"], ["fast_step"])[0]
    assert row["floor_s"] == pytest.approx((0.16 + 0.08) / 2)
    assert row["vs_trl_at_floor"] == pytest.approx((1.2 / 0.16 + 0.8 / 0.08) / 2)
    assert row["peak_share"] == pytest.approx(0.4)  # 0.16 / 0.4 and 0.08 / 0.2
    assert row["train_peak_share"] == pytest.approx(0.6)  # 12 GFLOP in 0.2 s of 100, in 0.1 s of 200
    assert row["generate_peak_share"] == pytest.approx((0.2 + 0.1) / 2)  # over the engine's 0.2 s
    table = ladder.peak_table([row], "llama-4.7m")
    assert [c.header for c in table.columns][-2:] == ["x TRL at the floor", "x TRL"]
    for rnd in rounds:
        del rnd["levels"][("grpo", "fast_step")]["model_gflops"]
    assert "floor_s" not in ladder.summarise(rounds, ["grpo"], ["fast_step"])[0]


def test_rl_ladder_refuses_unknown_shapes_and_levels_before_running_anything():
    for args, message in (
        (["--shapes", "dpo"], "unknown shape 'dpo'; shapes: grpo, ppo, grpo_rm"),
        (["--levels", "turbo"], "unknown level 'turbo'"),
        (["--model", "llama-1b"], "invalid choice: 'llama-1b'"),
        (["--iterations", "1"], "--iterations must be >= 2"),
    ):
        done = subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / "rl_ladder.py"), *args],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
        )
        assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


def test_rl_ladder_models_are_the_issues_shapes_and_grpo_rm_scores_with_the_reward_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    ladder = rl_ladder()
    setup = sys.modules["rl_setup"]
    sizes = {}
    for name, shape in setup.MODELS.items():
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**shape))
        sizes[name] = round(sum(p.numel() for p in model.parameters()) / 1e6, 1)
    assert sizes == {"llama-4.7m": 4.7, "llama-115m": 114.8}
    # GRPO-RM: GRPO's shape with no reward function, so the reward model alone scores; PPO's reward model too.
    assert ladder.SHAPES["grpo_rm"] == {**ladder.SHAPES["grpo"], "reward_functions": []}
    assert ladder.WITH_REWARD_MODEL == {"grpo": False, "grpo_rm": True, "ppo": True}


def test_trl_baseline_takes_a_reward_model_for_grpo_rm_only():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import trl_baseline
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    args = trl_baseline.parse_args(["--model-dir", "m", "--shape", "grpo_rm", "--reward-model-dir", "rm"])
    assert args.reward_model_dir == Path("rm")
    for argv in (["--shape", "grpo_rm"], ["--shape", "grpo", "--reward-model-dir", "rm"]):
        with pytest.raises(SystemExit) as stopped:
            trl_baseline.parse_args(["--model-dir", "m", *argv])
        assert stopped.value.code == 2


@pytest.mark.slow
@pytest.mark.heavy  # tests/flows/test_prefect_server.py checks the kept server, test_pipeline.py the cache
def test_startup_times_the_first_rl_iteration_of_a_cached_run(tmp_path):
    """One measured run of configs/tiny.yaml after the caching run: the RL stage ran again (its parts add up
    to when its first iteration began, which ended after it began), and a fully cached run after; both on the
    Prefect server the caching run started and kept, which the benchmark stops at its end."""
    rows = json.loads(_run("startup.py", "--runs", "1", "--workdir", str(tmp_path), "--json"))
    measured, cached = rows
    assert (measured["run"], cached["run"]) == ("1", "all cached")
    assert measured["server"] == cached["server"] == "kept from a run before"
    # The server published its state file when it started and withdrew it when it stopped.
    assert (tmp_path / "prefect-home" / "alignflow-server").is_dir()
    assert not list((tmp_path / "prefect-home" / "alignflow-server").glob("*.json"))
    parts = measured["orchestration_s"] + measured["process_s"] + measured["setup_s"]
    assert parts == pytest.approx(measured["began_s"], abs=1e-6)
    assert 0 < measured["process_s"] and 0 < measured["setup_s"] < measured["began_s"] < measured["ended_s"]
    assert measured["ended_s"] < measured["wall_s"] and cached["wall_s"] > 0


def test_decode_fusions_rows_add_one_fused_op_each():
    """Each row of benchmarks/decode_fusions.py is the row before it plus one change, so its `bought` column
    is what that change saved."""
    from alignflow.config import EngineConfig
    from alignflow.kernels.decode_step import FUSED_OPS

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import decode_fusions
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    configs = decode_fusions.row_configs(EngineConfig(max_batch_size=4))
    assert list(configs) == list(decode_fusions.ROWS)
    assert configs["eager ops"].gpu_decode_kernels == "torch"
    fused = [c.gpu_fused_ops for c in configs.values()][1:-1]
    assert fused == [list(FUSED_OPS[:n]) for n in range(len(FUSED_OPS) + 1)]
    middle = list(configs.values())[1:-1]
    assert all(c.gpu_decode_kernels == "triton" and not c.cuda_graph_loop for c in middle)
    last = configs["+ sampler in graph"]
    assert last.cuda_graph_loop and last.gpu_fused_ops == list(FUSED_OPS) and last.max_batch_size == 4


def test_decode_fusions_on_cpu_asks_for_the_triton_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(REPO / "benchmarks/decode_fusions.py"), "--device", "cpu"],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert done.returncode == 2 and "set TRITON_INTERPRET=1" in done.stderr
