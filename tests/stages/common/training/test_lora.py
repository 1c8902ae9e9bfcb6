"""LoRA helpers: config checks naming the key, only adapters trainable, merged weights equal base + adapter.

The models run on the session's device (--device); a saved checkpoint is loaded back onto it."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from alignflow.config import LoRAConfig
from alignflow.stages.common.training.lora import (
    LoRAConfigError,
    apply_lora,
    merged_adapted_weights,
    merged_state_dict,
    parameter_counts,
    save_merged,
)

LLAMA = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
    max_position_embeddings=64,
    tie_word_embeddings=True,
    pad_token_id=0,
)


def _trained_adapter(model: torch.nn.Module, seed: int = 0) -> None:
    """Non-zero adapters (peft initialises B to 0, which would make every merge check trivially pass)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)


def test_only_adapters_are_trainable_and_off_means_untouched():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    assert apply_lora(model, LoRAConfig(rank=0), "sft.lora") is model
    lora = apply_lora(model, LoRAConfig(rank=4, target_modules=["q_proj", "v_proj"]), "sft.lora")
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    assert len(trainable) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
    count, total = parameter_counts(lora)
    # q: A 4x32 + B 32x4; v (2 KV heads of 8): A 4x32 + B 16x4; two layers.
    assert count == 2 * ((4 * 32 + 32 * 4) + (4 * 32 + 16 * 4))
    assert total == count + sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**LLAMA)).parameters())


def test_unknown_target_module_names_the_key_and_the_valid_names():
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    with pytest.raises(
        LoRAConfigError,
        match=r"^ppo.lora.target_modules: 'qproj' matches no linear layer of the "
        r"model \(LlamaForCausalLM\); its linear layers are: down_proj, "
        r"gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj$",
    ):
        apply_lora(model, LoRAConfig(rank=4, target_modules=["q_proj", "qproj"]), "ppo.lora")


@pytest.mark.parametrize("classifier", [False, True])
def test_merged_weights_equal_base_plus_adapter(classifier, tmp_path, device):
    torch.manual_seed(1)
    model_class = LlamaForSequenceClassification if classifier else LlamaForCausalLM
    base = (
        model_class(LlamaConfig(**LLAMA, num_labels=1) if classifier else LlamaConfig(**LLAMA))
        .eval()
        .to(device)
    )
    base_weights = {k: v.clone() for k, v in base.state_dict().items()}  # peft injects adapters into `base`
    lora = apply_lora(
        base,
        LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
        "reward.lora",
        classifier=classifier,
    )
    _trained_adapter(lora)
    ids = torch.randint(1, 300, (3, 11)).to(device)
    with torch.no_grad():
        expected = lora(input_ids=ids).logits
    merged = merged_state_dict(lora)
    assert not any("lora_" in k or "base_layer" in k or "modules_to_save" in k for k in merged)
    plain = model_class(base.config).eval().to(device)
    missing, unexpected = plain.load_state_dict(merged, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    adapted = dict(merged_adapted_weights(lora))
    assert sorted(adapted) == sorted(
        f"model.layers.{i}.{m}.weight"
        for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
    )
    for name, weight in adapted.items():
        # The refit stream stays on the model's device; the merged state dict is CPU copies (what is saved).
        assert weight.device.type == torch.device(device).type
        torch.testing.assert_close(weight.cpu(), merged[name], rtol=0, atol=0)
    # The saved checkpoint is a plain HF model; the adapter files beside it load onto the base with peft.
    import peft

    save_merged(lora, tmp_path)
    reloaded = model_class.from_pretrained(tmp_path).eval().to(device)
    fresh_base = model_class(base.config).eval().to(device)
    fresh_base.load_state_dict(base_weights)
    with_adapter = peft.PeftModel.from_pretrained(fresh_base, tmp_path / "adapter").eval().to(device)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(with_adapter(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_adapters_disabled_is_the_frozen_base_without_a_copy(device):
    from alignflow.stages.common.training.lora import AdaptersDisabled

    torch.manual_seed(2)
    base = LlamaForCausalLM(LlamaConfig(**LLAMA)).eval().to(device)
    reference = LlamaForCausalLM(base.config).eval().to(device)
    reference.load_state_dict(base.state_dict())
    lora = apply_lora(base, LoRAConfig(rank=4, target_modules=["q_proj", "v_proj"]), "ppo.lora")
    _trained_adapter(lora)
    frozen = AdaptersDisabled(lora)
    ids = torch.randint(1, 300, (2, 9)).to(device)
    with torch.no_grad():
        torch.testing.assert_close(
            frozen(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=0
        )
        assert (
            lora(input_ids=ids).logits - reference(input_ids=ids).logits
        ).abs().max() > 1e-3  # adapters back on
    assert list(frozen.parameters()) == []
