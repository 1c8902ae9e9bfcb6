"""The native forward pass: a prefill over the real tokens only (packed rows) equals the padded prefill."""

from __future__ import annotations

import pytest
import torch
from engine_test_models import engine_config, random_prompts

from alignflow.stages.common.generation.native import NativeEngine
from alignflow.stages.common.generation.native.model import prefill_masks


@pytest.mark.parametrize("name", ["llama_gqa_tied_llama3", "qwen2_bias_window"])
@pytest.mark.parametrize("logits_for", ["last", "all"])
def test_packed_prefill_equals_the_padded_one(tiny_checkpoints, name, logits_for, device):
    engine = NativeEngine.build(tiny_checkpoints[name], engine_config(cpu_prepack=False), device=device)
    model, spec = engine.model, engine.spec
    prompts = random_prompts(6, seed=11)
    B, S = len(prompts), max(map(len, prompts))
    # The model's inputs on its device, as the engine's own prefill makes them.
    tokens = torch.tensor([[0] * (S - len(p)) + p for p in prompts], device=device)
    pad = torch.tensor([S - len(p) for p in prompts], device=device)
    positions = (torch.arange(S, device=device)[None, :] - pad[:, None]).clamp(min=0)
    masks = prefill_masks(spec, pad, S)
    padded_cache, packed_cache = engine._new_cache(), engine._new_cache()
    want = model.forward(padded_cache, tokens, positions, 0, masks, logits_for=logits_for)
    got = model.forward(packed_cache, tokens, positions, 0, masks, logits_for=logits_for, pad=pad)
    assert got.shape == want.shape
    real = torch.arange(S, device=device)[None, :] >= pad[:, None]  # [B, S]
    if logits_for == "all":
        # Real positions agree (another row count per GEMM: another summation order); padding gives zeros.
        torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-5)
        assert (got[~real] == 0).all()
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for layer in range(spec.num_layers):
        for packed_kv, padded_kv in ((packed_cache.k[layer], padded_cache.k[layer]),
                                     (packed_cache.v[layer], padded_cache.v[layer])):
            slots = packed_kv[:B, :, :S].transpose(1, 2)  # [B, S, kv_heads, D]
            torch.testing.assert_close(
                slots[real], padded_kv[:B, :, :S].transpose(1, 2)[real], rtol=0, atol=1e-5
            )
            assert (slots[~real] == 0).all(), "padding slots hold zero keys and values"


def test_a_batch_without_padding_takes_the_plain_path(tiny_checkpoints, device):
    engine = NativeEngine.build(
        tiny_checkpoints["llama_mha_untied"], engine_config(cpu_prepack=False), device=device
    )
    tokens = torch.randint(3, 256, (3, 7), generator=torch.Generator().manual_seed(2)).to(device)
    positions = torch.arange(7, device=device)[None, :].expand(3, 7)
    pad = torch.zeros(3, dtype=torch.long, device=device)
    masks = prefill_masks(engine.spec, pad, 7)
    got = engine.model.forward(engine._new_cache(), tokens, positions, 0, masks, pad=pad)
    want = engine.model.forward(engine._new_cache(), tokens, positions, 0, masks)
    assert torch.equal(got, want)
