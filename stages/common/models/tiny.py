"""The tiny-model factory: a byte-level BPE tokenizer trained on the data, a random Llama sized by config.

What this is: how the CPU demo and the tests get a base model without downloading one. What it is
not: a loader (stages/common/models/loading.py loads every saved model, tiny or not).

Tokenizer conventions (kept in the saved tokenizer files, so every stage sees the same ids):

    <|bos|>  id 0   beginning of sequence (not added automatically: no post-processor)
    <|eos|>  id 1   end of a completion; SFT appends it, generation stops on it
    <|pad|>  id 2   padding only, never trained on; distinct from eos so "stop" is learnable

Byte-level means every string encodes (256 byte tokens) and decode(encode(text)) == text.
The chat template renders turns as "<Role>:\\n<content>\\n" and the generation prompt as
"Assistant:\\n", the same text as formats.render_messages_fallback.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from alignflow.config import TinyModelConfig

if TYPE_CHECKING:  # torch/transformers are imported inside the functions: importing this module is cheap
    from transformers import (
        LlamaForCausalLM,
        PreTrainedModel,
        PreTrainedTokenizerBase,
        PreTrainedTokenizerFast,
    )

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)  # ids 0, 1, 2 in this order
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # every byte plus the specials

# "<Role>:\n<content>\n" per turn, then "Assistant:\n" (newline-terminated: a BPE boundary, so the prompt's
# tokens are a prefix of prompt+completion tokens). Jinja's trim_blocks only eats newlines after tags.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}:\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:\n{% endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE with `vocab_size` entries at most (fewer only if the texts run out of merges).

    Specials <|bos|>=0, <|eos|>=1, <|pad|>=2; ByteLevel pre-tokenizer and decoder (no prefix space);
    chat template CHAT_TEMPLATE; padding side right (loading.load_tokenizer can switch it).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size={vocab_size} is too small: a byte-level BPE needs >= {MIN_VOCAB} "
                         f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
    if not texts:
        raise ValueError("train_tokenizer needs at least one text")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,  # a merge seen once is noise, not vocabulary
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="right",
        clean_up_tokenization_spaces=False,  # cleanup rewrites " ." -> "." and would break lossless decode
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> LlamaForCausalLM:
    """A random-init LlamaForCausalLM (float32) sized by `cfg`, with bos/eos/pad ids from `tokenizer`.

    The init uses its own RNG stream (torch.random.fork_rng), so the global torch seed is untouched
    and the same (cfg, seed) gives the same weights.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if len(tokenizer) > cfg.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but model.tiny.vocab_size={cfg.vocab_size}; "
                         f"raise model.tiny.vocab_size to at least {len(tokenizer)}")
    ids = {name: getattr(tokenizer, f"{name}_token_id") for name in ("bos", "eos", "pad")}
    missing = [name for name, value in ids.items() if value is None]
    if missing:
        raise ValueError(
            f"tokenizer has no {', '.join(missing)} token; use "
            "alignflow.stages.common.models.tiny.train_tokenizer or set them before making the model"
        )
    config = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        rms_norm_eps=1e-5,
        initializer_range=0.02,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"]
    )
    return model.float().eval()


def save_base_model(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: str | os.PathLike[str]
) -> Path:
    """save_pretrained model (safetensors) and tokenizer into `out_dir`; returns the directory."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if (
        not (out_dir / "model.safetensors").is_file()
        and not (out_dir / "model.safetensors.index.json").is_file()
    ):
        raise RuntimeError(
            f"{out_dir}: save_pretrained wrote no safetensors weights; files: "
            f"{sorted(p.name for p in out_dir.iterdir())}"
        )
    return out_dir
