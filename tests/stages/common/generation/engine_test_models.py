"""Tiny random Llama-family checkpoints, tolerances and prompt helpers of the engine tests (no tests)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

# Each variant exercises a different part of the native engine against transformers.
ARCHITECTURES: dict[str, dict] = {
    # Multi-head attention, untied embeddings, default RoPE.
    "llama_mha_untied": {"model_type": "llama", "num_key_value_heads": 4, "tie_word_embeddings": False},
    # Grouped-query attention (2 query heads per KV head), tied embeddings, llama3 RoPE scaling.
    "llama_gqa_tied_llama3": {
        "model_type": "llama",
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    },
    # Qwen2: QKV bias, 4 query heads on 1 KV head, the second layer with a 6-token sliding window.
    "qwen2_bias_window": {
        "model_type": "qwen2",
        "num_key_value_heads": 1,
        "tie_word_embeddings": False,
        "use_sliding_window": True,
        "sliding_window": 6,
        "max_window_layers": 1,
    },
    # Mistral: head_dim 32 != hidden / heads, linear RoPE scaling, an 8-token sliding window.
    "mistral_linear_window": {
        "model_type": "mistral",
        "num_key_value_heads": 2,
        "head_dim": 32,
        "sliding_window": 8,
        "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    },
    # Llama with attention_bias (q, k, v and o biases) and yarn RoPE.
    "llama_bias_yarn": {
        "model_type": "llama",
        "num_key_value_heads": 2,
        "attention_bias": True,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
}

EOS_ID = 2


def tiny_config(name: str, **overrides):
    """A transformers config for architecture variant `name` (hidden 64, 2 layers, vocab 256)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    spec = dict(ARCHITECTURES[name])
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[spec.pop("model_type")]
    kwargs = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=256,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=EOS_ID,
        pad_token_id=0,
        initializer_range=0.1,
    )
    kwargs.update(spec)
    kwargs.update(overrides)
    return cls(**kwargs)


def save_tiny_model(path: Path, name: str, seed: int = 0, bias_std: float = 0.0, **overrides) -> Path:
    """Random-init a tiny causal LM of variant `name` and save_pretrained it (safetensors) into `path`.

    transformers initialises linear biases to zero, so a wrong bias (added twice, to the wrong
    columns) changes nothing; bias_std > 0 draws them from N(0, bias_std^2) instead.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(name, **overrides), attn_implementation="sdpa")
    if bias_std:
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param_name.endswith(".bias"):
                    param.normal_(0.0, bias_std)
    model.save_pretrained(path)
    return path


# Tolerances of every engine-vs-reference comparison, in one place. fp32 everywhere: the native
# engine fuses GEMMs (QKV, gate/up) and reads keys from its cache, which moves the last bits of
# fp32 sums; measured max |diff| is ~3e-6 on these models, so 1e-4 still catches any real bug
# (a wrong mask or RoPE position moves logits by >1e-2).
TOLERANCES = {
    "logits_fp32": 1e-4,
    "logprobs_fp32": 1e-4,
    # Same prompt in another batch position / batch size: GEMM blocking differs with the batch
    # size, which changes fp32 rounding; the tokens must still be identical.
    "logprobs_across_batches_fp32": 1e-5,
    # Tensor parallel (2 gloo ranks) against one device: the row-parallel o_proj and down_proj sum two
    # half-width products (another fp32 summation order), and the halves run other GEMM shapes; the
    # embedding and the gathered LM head are exact. Measured max |diff| 2.4e-6 (test_tensor_parallel).
    "tp_logits_fp32": 1e-4,
    "tp_logprobs_fp32": 1e-4,
}


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap_in_use() -> int | None:
    """Bytes malloc has handed out right now (torch's CPU allocator uses malloc), or None off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def memory_in_use(device: str) -> int | None:
    """Bytes allocated on `device` right now: torch's CUDA allocator on cuda, malloc's heap on the CPU (None
    off glibc). What an engine allocates while it works shows here on its own device."""
    if torch.device(device).type == "cuda":
        return torch.cuda.memory_allocated(device)
    return heap_in_use()


def random_prompts(
    batch: int, seed: int = 0, vocab: int = 256, lengths: tuple[int, int] = (1, 14)
) -> list[list[int]]:
    """`batch` prompts of different lengths (ids >= 3: clear of pad/bos/eos)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1], (batch,), generator=gen).tolist()
    if batch > 1:  # make sure one batch mixes a short and a long prompt
        sizes[0], sizes[-1] = lengths[0] + 1, lengths[1] - 1
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in sizes]


def engine_config(**overrides):
    from alignflow.config import EngineConfig

    # The C++ decode loop (engine.cpu_decode_loop, on by default) replaces the torch step on AVX-512 CPUs: off
    # here, so these tests keep testing the torch step on every CPU; test_engine_decode_loop.py turns it on
    # and checks the loop against that step.
    values = {"max_batch_size": 8, "max_seq_len": 64, "cuda_graphs": False, "cpu_decode_loop": False}
    values.update(overrides)
    return EngineConfig(**values)


def assert_generates_alike(engine, reference, prompts, sampling):
    """`engine` samples `reference`'s tokens with logits within TOLERANCES["logits_fp32"]; returns the
    reference's generation."""
    got = engine.generate(prompts, sampling, return_logits=True)
    want = reference.generate(prompts, sampling, return_logits=True)
    assert got.response_token_ids == want.response_token_ids
    worst = max((x - y).abs().max().item() for x, y in zip(got.logits, want.logits, strict=True))
    assert worst <= TOLERANCES["logits_fp32"]
    return want


def perturbed_checkpoint(source: Path, dest: Path, scale: float = 0.05, seed: int = 1) -> Path:
    """A copy of `source` with every weight moved by noise (what a PPO step does), saved as safetensors."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * scale * param.std().clamp(min=1e-3))
    model.save_pretrained(dest)
    return dest
