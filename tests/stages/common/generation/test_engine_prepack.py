"""CPU weight prepacking: packed copies give F.linear's results, are never used stale, leave with the engine.

A CPU path: every engine here is built with device="cpu" (the default device is the GPU wherever there is
one)."""

from __future__ import annotations

import gc

import pytest
import torch
from engine_test_models import TOLERANCES, engine_config, perturbed_checkpoint, random_prompts

from alignflow.kernels import skinny_linear as skinny
from alignflow.stages.common.generation import SamplingParams, build_engine
from alignflow.stages.common.generation.native import NativeEngine, prepack
from alignflow.stages.common.generation.native.weights import checkpoint_tensors

SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)

pytestmark = [
    pytest.mark.cpu_only("weight prepacking and the CPU kernels it selects"),
    pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"),
]


@pytest.fixture(autouse=True)
def pack_small_weights(monkeypatch):
    """The tiny test models' weights are all under oneDNN's MIN_PACKED_BYTES floor: pack them anyway, so the
    packed paths run here. test_weights_under_the_floor_stay_plain puts the floor back."""
    monkeypatch.setattr(prepack, "MIN_PACKED_BYTES", {"onednn": 0, "blocked": 0, "blocked-avx2": 0})


def _calls() -> dict[str, int]:
    return dict(prepack.calls)


def _delta(before: dict[str, int]) -> dict[str, int]:
    return {k: prepack.calls[k] - before[k] for k in before}


@pytest.fixture
def force_layout(monkeypatch):
    """Make engines built after this call pack in `layout` (skipping where it cannot run here)."""

    def force(layout: str, dtype: str = "float32") -> None:
        if layout == "blocked" and not skinny.available():
            pytest.skip(f"skinny_linear unavailable: {skinny.unavailable_reason()}")
        if layout == "onednn" and dtype == "bfloat16" and not torch.cpu._is_avx512_supported():
            pytest.skip(
                "oneDNN packs bf16 weights only with AVX-512 (prepack.layout_for leaves them plain here)"
            )
        monkeypatch.setattr(prepack, "layout_for", lambda device, dtype, kernels=True: layout)

    return force


@pytest.mark.parametrize(
    "dtype, layout", [("float32", "blocked"), ("float32", "onednn"), ("bfloat16", "onednn")]
)
def test_prepacked_engine_matches_the_plain_one(tiny_checkpoints, force_layout, dtype, layout):
    force_layout(layout, dtype)
    path = tiny_checkpoints["qwen2_bias_window"]  # QKV bias: the bias is added after the packed GEMM
    prompts = random_prompts(5, seed=2)
    plain = NativeEngine.build(path, engine_config(cpu_prepack=False), dtype=dtype, device="cpu")
    packed = NativeEngine.build(path, engine_config(), dtype=dtype, device="cpu")
    assert plain._prepacked is None and packed._prepacked.layout == layout
    before = _calls()
    got = packed.forward_logits(prompts)  # 5 x 13 = 65 rows: within skinny_linear.MAX_ROWS
    # 4 linears x 2 layers + the head
    assert _delta(before) == {
        "packed": 4 * 2 + 1,
        "fallback": 0,
        "plain": 0,
    }
    want = plain.forward_logits(prompts)
    worst = max((a - b).abs().max().item() for a, b in zip(got, want, strict=True))
    # oneDNN gives 0.0 in both dtypes on x86 CPUs with AVX-512. Bounds that still allow another summation
    # order (the blocked kernel's, another CPU's oneDNN kernel): the fp32 parity tolerance, and one bf16
    # ulp of the largest logit.
    largest = max(w.abs().max().item() for w in want)
    assert worst <= (TOLERANCES["logits_fp32"] if dtype == "float32" else largest * 2**-7)
    if dtype == "float32":
        assert (
            packed.generate(prompts, SAMPLED).response_token_ids
            == plain.generate(prompts, SAMPLED).response_token_ids
        )


def test_blocked_layout_leaves_a_long_prefill_to_f_linear(tiny_checkpoints, force_layout):
    """Beyond skinny_linear.max_rows() rows (128 for the AVX-512 build, 256 for the AVX2 one) the GEMM is
    compute-bound and MKL's F.linear is as fast: used by design."""
    force_layout("blocked")
    path = tiny_checkpoints["llama_mha_untied"]
    prompts = random_prompts(8, seed=5, lengths=(30, 60))  # the prefill's rows are the prompts' tokens
    assert sum(map(len, prompts)) > skinny.max_rows()
    packed = NativeEngine.build(path, engine_config(max_seq_len=96), device="cpu")
    plain = NativeEngine.build(path, engine_config(cpu_prepack=False, max_seq_len=96), device="cpu")
    before = _calls()
    got = packed.forward_logits(prompts)
    assert _delta(before) == {"packed": 0, "fallback": 0, "plain": 4 * 2 + 1}
    want = plain.forward_logits(prompts)
    assert max((a - b).abs().max().item() for a, b in zip(got, want, strict=True)) == 0.0
    before = _calls()
    packed.generate(prompts, SAMPLED)  # the decode steps (8 rows) take the kernel
    assert _delta(before)["packed"] > 0 and _delta(before)["fallback"] == 0


def test_a_write_behind_the_engines_back_falls_back_to_the_new_weights(tiny_checkpoints):
    """A packed copy is tied to its buffer's version counter: after any in-place write it is not used."""
    path = tiny_checkpoints["llama_mha_untied"]
    prompts = random_prompts(3, seed=4)
    engine = NativeEngine.build(path, engine_config(), device="cpu")
    reference = NativeEngine.build(path, engine_config(cpu_prepack=False), device="cpu")
    for e in (engine, reference):
        e.weights.buffers["down_w"].mul_(1.5)  # not through refit: nothing repacks
    before = _calls()
    got = engine.forward_logits(prompts)
    delta = _delta(before)
    assert delta["fallback"] == 2 and delta["packed"] == 3 * 2 + 1  # only down_w (2 layers) falls back
    want = reference.forward_logits(prompts)
    assert (
        max((a - b).abs().max().item() for a, b in zip(got, want, strict=True)) <= TOLERANCES["logits_fp32"]
    )


def test_refit_repacks_and_the_table_empties_with_the_engine(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints["llama_gqa_tied_llama3"]
    prompts = random_prompts(4, seed=6)
    engine = NativeEngine.build(path, engine_config(), device="cpu")
    keys = list(engine._prepacked.keys)
    assert keys and all(key in prepack._TABLE for key in keys)
    copies = {key: prepack._TABLE[key][0] for key in keys}

    perturbed = perturbed_checkpoint(path, tmp_path / "p")
    engine.refit(checkpoint_tensors(perturbed))
    # rewritten in place (skinny.block_weight's out), not reallocated
    if engine._prepacked.layout == "blocked":
        assert all(prepack._TABLE[key][0] is copies[key] for key in keys)
    before = _calls()
    got = engine.generate(prompts, SAMPLED).response_token_ids
    assert _delta(before)["fallback"] == 0  # refit left current packed copies behind
    fresh = NativeEngine.build(perturbed, engine_config(cpu_prepack=False), device="cpu")
    assert got == fresh.generate(prompts, SAMPLED).response_token_ids

    engine.unload(keep_weights=False)
    assert not any(key in prepack._TABLE for key in keys)
    engine.reload()
    engine.refit(checkpoint_tensors(perturbed))
    keys = list(engine._prepacked.keys)
    assert all(key in prepack._TABLE for key in keys)
    del engine
    gc.collect()
    assert not any(key in prepack._TABLE for key in keys)


@pytest.mark.slow
def test_compiled_step_uses_the_packed_weights_without_graph_breaks(tiny_checkpoints):
    """One graph per compiled function: a graph break (e.g. a SymBool reaching SDPA, or a host sync in
    the sampler) splits the decode step at every layer, at a large cost to its speed."""
    from torch._dynamo.utils import counters

    path = tiny_checkpoints["llama_gqa_tied_llama3"]
    prompts = random_prompts(4, seed=8)
    counters.clear()
    engine = NativeEngine.build(path, engine_config(compile=True), device="cpu")  # compiles (warmup)
    assert dict(counters["graph_break"]) == {}
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    engine.generate(prompts, SAMPLED)
    engine.generate(random_prompts(7, seed=9), SAMPLED)
    # The build compiled for every batch size and cache slot: nothing is recompiled later (a warm-up
    # whose batch size equalled the model's KV-head count once made the first generate recompile).
    assert counters["stats"]["unique_graphs"] == graphs
    before = _calls()
    engine.generate(prompts, SAMPLED)
    delta = _delta(before)
    assert delta["fallback"] == 0 and delta["packed"] > 0
    paths = engine.execution_paths()
    from alignflow.kernels import _cpu_extension
    from alignflow.kernels._triton_dispatch import cpp_available

    cpp = (
        "sample_tokens (AVX-512 C++)"
        if _cpu_extension.extension() is not None
        else "sample_tokens (AVX2 C++)"
    )
    sampler = cpp if cpp_available() else "sample_tokens (torch reference), compiled"
    assert (paths["decode_step"], paths["sampler"]) == ("torch.compile", sampler)


def test_cpu_kernels_switch_selects_the_cpp_kernels_or_torch_and_onednn(tiny_checkpoints):
    from alignflow.kernels import decode_attention

    if not skinny.available():
        pytest.skip(f"CPU kernels unavailable: {skinny.unavailable_reason()}")
    path = tiny_checkpoints["llama_gqa_tied_llama3"]  # head_dim 16: the attention kernel applies
    prompts = random_prompts(5, seed=12)
    fast = NativeEngine.build(path, engine_config(), device="cpu")
    plain = NativeEngine.build(path, engine_config(cpu_kernels=False), device="cpu")
    # The attention kernel has no AVX2 build: on an AVX2 CPU only the linears (and the sampler) switch.
    assert (fast._prepacked.layout, fast.model.cpu_attention) == ("blocked", decode_attention.available())
    assert (plain._prepacked.layout, plain.model.cpu_attention) == ("onednn", False)
    a = fast.generate(prompts, SAMPLED.model_copy(update={"seed": 5}), return_logits=True)
    b = plain.generate(prompts, SAMPLED.model_copy(update={"seed": 5}), return_logits=True)
    assert a.response_token_ids == b.response_token_ids
    worst = max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits, strict=True))
    assert worst <= TOLERANCES["logits_fp32"]


def test_execution_paths_name_the_code_that_runs_and_why_a_fast_path_does_not(
    tiny_checkpoints, tmp_path, monkeypatch
):
    import torch.utils.cpp_extension
    from engine_test_models import save_tiny_model

    from alignflow.kernels import _cpu_extension

    if not skinny.available():
        pytest.skip(f"CPU kernels unavailable: {skinny.unavailable_reason()}")
    path = tiny_checkpoints["llama_gqa_tied_llama3"]  # head_dim 16: the attention kernel applies
    fast = NativeEngine.build(path, engine_config(), device="cpu").execution_paths()
    if _cpu_extension.extension() is not None:
        isa, rows, attention = "AVX-512", 128, "decode_attention (AVX-512 C++)"
    else:  # the AVX2 builds: linears and sampler, no attention kernel
        isa, rows = "AVX2", 256
        attention = "torch (one query per row, KV groups folded); no C++ kernel: this CPU has no AVX-512"
    assert fast == {
        "backend": "native",
        "device": "cpu",
        "dtype": "float32",
        "decode_step": "eager",
        "linear": f"skinny_linear ({isa} C++) up to {rows} rows, F.linear above",
        "decode_attention": attention,
        "prefill_attention": "sdpa",
        "sampler": f"sample_tokens ({isa} C++)",
        "decode_loop": "not used: off (engine.cpu_decode_loop: false)",
    }
    off = NativeEngine.build(path, engine_config(cpu_kernels=False), device="cpu").execution_paths()
    assert off["linear"] == "oneDNN prepacked" and off["decode_attention"].startswith("torch")
    assert (
        off["cpu_kernels"] == "off (engine.cpu_kernels: false)"
        and off["sampler"] == "sample_tokens (chunked torch)"
    )
    plain = NativeEngine.build(path, engine_config(cpu_prepack=False), device="cpu").execution_paths()
    assert plain["linear"] == "F.linear" and plain["cpu_prepack"] == "off (engine.cpu_prepack: false)"
    assert plain["decode_attention"] == fast["decode_attention"]  # attention does not need the prepack
    hf = build_engine(path, engine_config(backend="hf"), device="cpu").execution_paths()
    assert hf == {
        "backend": "hf",
        "device": "cpu",
        "dtype": "float32",
        "decode_step": "transformers generate",
        "attention": "sdpa",
        "sampler": f"sample_tokens ({isa} C++)",
    }
    odd_head = save_tiny_model(tmp_path / "head24", "llama_mha_untied", head_dim=24)
    odd = NativeEngine.build(odd_head, engine_config(), device="cpu").execution_paths()
    assert odd["linear"] == fast["linear"]
    if isa == "AVX-512":
        assert odd["decode_attention"].endswith("takes head_dim a multiple of 16 up to 256, not 24")

    def no_compiler(*args, **kwargs):
        raise RuntimeError("error: command 'c++' failed: No such file or directory")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    _cpu_extension.reset()
    try:
        with pytest.warns(RuntimeWarning, match="fall back to torch"):
            failed = NativeEngine.build(path, engine_config(), device="cpu").execution_paths()
    finally:
        _cpu_extension.reset()  # the next caller loads the cached build again
    assert failed["linear"] == "oneDNN prepacked" and failed["decode_attention"].startswith("torch")
    assert failed["sampler"] == "sample_tokens (chunked torch)"
    assert failed["cpu_kernels"].startswith("unavailable: building ")
    assert "error: command 'c++' failed" in failed["cpu_kernels"]


def test_without_avx512_the_engines_run_the_avx2_cpp_kernels_unless_cpu_kernels_is_off(tiny_checkpoints):
    """On an AVX2 CPU the C++ kernels' AVX-512 build does not run, but the AVX2 build of the sampler and of
    skinny_linear does: the engines say so, and engine.cpu_kernels: false keeps the chunked torch sampler and
    oneDNN's linears (same tokens)."""
    from alignflow.kernels import _cpu_extension

    if _cpu_extension.extension() is not None or _cpu_extension.sampler() is None:
        pytest.skip("for CPUs with AVX2 and no AVX-512, where the AVX2 kernels build")
    path = tiny_checkpoints["llama_gqa_tied_llama3"]
    prompts = random_prompts(5, seed=12)
    native = NativeEngine.build(path, engine_config(), device="cpu")
    chunked = NativeEngine.build(path, engine_config(cpu_kernels=False), device="cpu")
    assert native.execution_paths()["sampler"] == "sample_tokens (AVX2 C++)"
    assert native.execution_paths()["linear"] == "skinny_linear (AVX2 C++) up to 256 rows, F.linear above"
    assert chunked.execution_paths()["sampler"] == "sample_tokens (chunked torch)"
    assert chunked.execution_paths()["linear"] == "oneDNN prepacked"
    hf = build_engine(path, engine_config(backend="hf"), device="cpu")
    assert hf.execution_paths()["sampler"] == "sample_tokens (AVX2 C++)"
    a = native.generate(prompts, SAMPLED.model_copy(update={"seed": 5}))
    b = chunked.generate(prompts, SAMPLED.model_copy(update={"seed": 5}))
    assert a.response_token_ids == b.response_token_ids
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), rtol=0, atol=1e-5)


def test_bf16_weights_are_packed_only_where_onednn_can():
    """oneDNN's bf16 reorder needs AVX-512 (it raises on AVX2-only CPUs): there bf16 weights stay plain."""
    cpu = torch.device("cpu")
    want = "onednn" if torch.backends.mkldnn.is_available() and torch.cpu._is_avx512_supported() else None
    assert prepack.layout_for(cpu, torch.bfloat16) == want
    assert prepack.layout_for(cpu, torch.float16) is None


def test_weights_under_the_floor_stay_plain(tiny_checkpoints, force_layout, monkeypatch):
    """oneDNN packing loses to F.linear on a weight that stays in L2 (prepack.MIN_PACKED_BYTES): an engine
    whose weights are all below the floor runs plain F.linear, without the custom op; one with some above
    packs those."""
    force_layout("onednn")
    path = tiny_checkpoints["qwen2_bias_window"]
    prompts = random_prompts(5, seed=2)
    plain = NativeEngine.build(path, engine_config(cpu_prepack=False), device="cpu")
    monkeypatch.setattr(prepack, "MIN_PACKED_BYTES", {"onednn": 1 << 20, "blocked": 0, "blocked-avx2": 0})
    small = NativeEngine.build(path, engine_config(), device="cpu")
    assert small._prepacked is None and small.model.linear is torch.nn.functional.linear
    assert small.execution_paths()["linear"] == (
        "F.linear (every weight is under 1024 KiB, where onednn packing does not pay)"
    )
    # A floor between the model's weight sizes: the gate/up and down weights (the largest, with the head) are
    # packed, the QKV and output projections are not.
    floor = plain.weights.buffers["gate_up_w"][0].nbytes
    assert plain.weights.buffers["qkv_w"][0].nbytes < floor and plain.weights.buffers["o_w"][0].nbytes < floor
    monkeypatch.setattr(prepack, "MIN_PACKED_BYTES", {"onednn": floor, "blocked": 0, "blocked-avx2": 0})
    mixed = NativeEngine.build(path, engine_config(), device="cpu")
    assert mixed._prepacked is not None
    before = _calls()
    got = mixed.forward_logits(prompts)
    head_packed = int(mixed.weights["lm_head"].nbytes >= floor)
    down_packed = int(mixed.weights.buffers["down_w"][0].nbytes >= floor)
    assert _delta(before) == {
        "packed": 2 * (1 + down_packed) + head_packed,
        "fallback": 0,
        "plain": 2 * (3 - down_packed) + 1 - head_packed,
    }
    want = plain.forward_logits(prompts)
    assert (
        max((a - b).abs().max().item() for a, b in zip(got, want, strict=True)) <= TOLERANCES["logits_fp32"]
    )
    assert (
        mixed.generate(prompts, SAMPLED).response_token_ids
        == plain.generate(prompts, SAMPLED).response_token_ids
    )


def test_the_avx2_blocked_kernel_has_onednns_floor_and_the_avx512_one_none(tiny_checkpoints, monkeypatch):
    """The AVX2 skinny_linear lost to plain F.linear on the demo model's weights (all under 256 KiB, in L2),
    so its blocked layout packs from prepack.MIN_PACKED_BYTES["blocked-avx2"]; the AVX-512 build packs every
    weight."""
    monkeypatch.undo()  # pack_small_weights' zero floors
    with monkeypatch.context() as patch:
        patch.setattr(skinny, "isa", lambda: "AVX2")
        assert prepack.min_packed_bytes("blocked") == prepack.MIN_PACKED_BYTES["blocked-avx2"] == 256 << 10
        patch.setattr(skinny, "isa", lambda: "AVX-512")
        assert prepack.min_packed_bytes("blocked") == 0
        assert prepack.min_packed_bytes("onednn") == 256 << 10
    if skinny.isa() != "AVX2":
        return
    engine = NativeEngine.build(tiny_checkpoints["llama_mha_untied"], engine_config(), device="cpu")
    assert engine._prepacked is None and engine.model.linear is torch.nn.functional.linear
    assert engine.execution_paths()["linear"] == (
        "F.linear (every weight is under 256 KiB, where blocked packing does not pay)"
    )
