"""Model FLOPs of a Llama-family forward and training step, against torch's count of a real model's GEMMs."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from alignflow.stages.common.generation.native.spec import spec_from_hf_config
from alignflow.stages.common.model_flops import (
    _keys_in,
    attended_keys,
    forward_flops,
    gpu_peak_tflops,
    linear_weights,
    spans_flops,
    training_flops,
)


def tiny_llama(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, max_position_embeddings=64,
                         attn_implementation="eager", **overrides)
    return LlamaForCausalLM(config)


def test_a_forward_and_a_training_step_count_what_torch_counts_of_the_model():
    """Eager attention computes every query against every key (T x T a sequence and layer), grouped-query
    heads included; torch's FlopCounterMode counts each matmul of the forward and of its backward."""
    model = tiny_llama()
    spec = spec_from_hf_config(model.config, 64)
    batch, width = 3, 10
    ids = torch.randint(0, 300, (batch, width))
    dense = forward_flops(spec, batch * width, spec.num_layers * batch * width * width, batch * width)

    with FlopCounterMode(display=False) as forward:
        model(ids)
    assert forward.get_total_flops() == dense
    with FlopCounterMode(display=False) as step:
        model(ids).logits.sum().backward()
    assert step.get_total_flops() == training_flops(dense)


def test_linear_weights_are_the_layers_parameters_less_the_norms():
    model = tiny_llama()
    spec = spec_from_hf_config(model.config, 64)
    in_layers = sum(p.numel() for name, p in model.model.layers.named_parameters() if "norm" not in name)
    assert linear_weights(spec) == in_layers


@pytest.mark.parametrize("window", [None, 1, 4, 7, 30])
def test_attended_keys_in_closed_form_equal_the_sum_over_positions(window):
    for start, end in [(0, 0), (0, 1), (0, 12), (3, 9), (5, 20), (9, 10)]:
        assert _keys_in(start, end, window) == sum(
            min(p + 1, window) if window else p + 1 for p in range(start, end))


def test_causal_spans_count_each_position_against_the_keys_before_it():
    """A causal forward over a prompt then its continuation (spans) costs what one token at a time does: the
    same positions, each against every key up to itself."""
    model = tiny_llama()
    spec = spec_from_hf_config(model.config, 64)
    assert attended_keys(spec, [(0, 4)]) == spec.num_layers * (1 + 2 + 3 + 4)
    whole = spans_flops(spec, [(0, 10)], head_rows=10)
    assert spans_flops(spec, [(0, 6), (6, 10)], head_rows=10) == whole
    assert whole == forward_flops(spec, 10, spec.num_layers * 55, 10)


def test_gpu_peaks_come_from_the_most_specific_name_and_unknown_ones_are_none():
    assert gpu_peak_tflops("NVIDIA H200", "bf16") == 989.4
    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3", "fp16") == 989.4  # fp16 at the bf16 tensor-core rate
    assert gpu_peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB", "tf32") == 156.0
    assert gpu_peak_tflops("NVIDIA GeForce RTX 4090", "bf16") is None
    assert gpu_peak_tflops("NVIDIA H200", "int8") is None
