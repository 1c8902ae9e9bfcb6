"""The tiny-model factory: tokenizer conventions, lossless BPE, model init, save/load trip."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from alignflow.config import DemoTaskConfig, TinyModelConfig
from alignflow.stages.common.models import tiny
from alignflow.stages.data import demo_task
from alignflow.stages.data.formats import Message, render_prompt

CFG = TinyModelConfig(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=384,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return demo_task.demo_corpus(DemoTaskConfig(seed=0), n_texts=300)


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return tiny.train_tokenizer(corpus, CFG.vocab_size)


# --- tokenizer -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab_size", [300, 512])
def test_vocab_size_is_as_configured(corpus, vocab_size):
    assert len(tiny.train_tokenizer(corpus, vocab_size)) == vocab_size


def test_special_tokens_have_fixed_ids_and_pad_is_not_eos(tokenizer):
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == tiny.SPECIAL_TOKENS
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2)
    assert tokenizer("Write about the ocean.\n")["input_ids"][0] != tokenizer.bos_token_id  # no auto-bos
    assert tokenizer.padding_side == "right"


def test_encode_decode_is_lossless(tokenizer, corpus):
    texts = corpus[:200] + ["café ☕ naïve\ttabs  double  spaces \n\n", "  leading space", "x" * 50, "A,B;C."]
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text
    # The merges learned something: demo text is well under one token per byte.
    sample = corpus[100]
    assert len(tokenizer(sample)["input_ids"]) < 0.5 * len(sample.encode())


def test_prompt_tokens_are_a_prefix_of_prompt_plus_completion_tokens(tokenizer):
    """Why prompts end with a newline: the SFT loss mask can count prompt tokens on the prompt alone."""
    for record in demo_task.make_sft(DemoTaskConfig(n_sft=100, seed=4)):
        prompt_ids = tokenizer(record.prompt)["input_ids"]
        full_ids = tokenizer(record.prompt + record.completion)["input_ids"]
        assert full_ids[: len(prompt_ids)] == prompt_ids


def test_chat_template_renders_the_same_text_as_the_fallback(tokenizer):
    messages = [Message(role="system", content="Be brief."), Message(role="user", content="Describe winter.")]
    assert render_prompt(messages, tokenizer) == "System:\nBe brief.\nUser:\nDescribe winter.\nAssistant:\n"
    assert render_prompt(messages, tokenizer) == render_prompt(messages)


def test_too_small_a_vocabulary_is_refused(corpus):
    with pytest.raises(ValueError, match=r"vocab_size=258 is too small: a byte-level BPE needs >= 259"):
        tiny.train_tokenizer(corpus, 258)


# --- model ------------------------------------------------------------------------------------------------


def test_model_follows_the_config_and_the_tokenizer(tokenizer):
    model = tiny.make_tiny_model(CFG, tokenizer, seed=0)
    config = model.config
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (32, 64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert (config.vocab_size, config.max_position_embeddings) == (384, 64)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (0, 1, 2)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight  # tied
    assert model.generation_config.pad_token_id == 2 and model.generation_config.eos_token_id == 1
    ids = torch.tensor([tokenizer("Write about the ocean.\nThe sea is calm.")["input_ids"]] * 3)
    with torch.no_grad():
        assert model(ids).logits.shape == (3, ids.shape[1], 384)


def test_init_is_seeded_and_leaves_the_global_rng_alone(tokenizer):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b = (tiny.make_tiny_model(CFG, tokenizer, seed=7) for _ in range(2))
    c = tiny.make_tiny_model(CFG, tokenizer, seed=8)
    assert torch.equal(torch.random.get_rng_state(), before)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_untied_config_and_a_too_large_tokenizer(tokenizer):
    model = tiny.make_tiny_model(CFG.model_copy(update={"tie_word_embeddings": False}), tokenizer, seed=0)
    assert model.get_input_embeddings().weight is not model.get_output_embeddings().weight
    with pytest.raises(ValueError, match=r"tokenizer has 384 tokens but model.tiny.vocab_size=300"):
        tiny.make_tiny_model(CFG.model_copy(update={"vocab_size": 300}), tokenizer, seed=0)


def test_save_then_from_pretrained_gives_identical_logits(tmp_path, tokenizer):
    model = tiny.make_tiny_model(CFG, tokenizer, seed=1)
    out = tiny.save_base_model(model, tokenizer, tmp_path / "base")
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    assert not any(name.endswith(".bin") for name in files)

    loaded = AutoModelForCausalLM.from_pretrained(out)
    loaded_tok = AutoTokenizer.from_pretrained(out)
    text = "Describe the forest.\nThe moss is lovely."
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert loaded_tok(text, return_tensors="pt")["input_ids"].tolist() == ids.tolist()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert loaded_tok.decode(ids[0]) == text
    assert loaded_tok.pad_token_id == 2 and loaded_tok.chat_template == tiny.CHAT_TEMPLATE
    assert loaded.generation_config.pad_token_id == 2
