"""Loading through from_pretrained: three architectures, reward-model heads, tokenizers and clear errors."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer
from transformers import (
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from alignflow.config import DemoTaskConfig, TinyModelConfig
from alignflow.stages.common.models import tiny
from alignflow.stages.common.models.loading import (
    ModelDirError,
    load_causal_lm,
    load_sequence_classifier,
    load_tokenizer,
    torch_dtype,
)
from alignflow.stages.data import demo_task

VOCAB = 320


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.train_tokenizer(demo_task.demo_corpus(DemoTaskConfig(seed=0), n_texts=200), VOCAB)


def make_gpt2(tok):
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    return GPT2LMHeadModel(config)


def make_qwen2(tok):
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    return Qwen2ForCausalLM(config)


def make_llama(tok):
    cfg = TinyModelConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=VOCAB, max_position_embeddings=64)
    return tiny.make_tiny_model(cfg, tok, seed=0)


ARCHITECTURES = {"gpt2": make_gpt2, "qwen2": make_qwen2, "llama": make_llama}


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def saved(request, tokenizer, tmp_path_factory):
    """(directory, the in-memory model) for each architecture, saved with save_pretrained."""
    torch.manual_seed(0)
    model = ARCHITECTURES[request.param](tokenizer).eval()
    out = tiny.save_base_model(model, tokenizer, tmp_path_factory.mktemp(request.param))
    return out, model


def batch(tok, texts, padding_side="right"):
    tok.padding_side = padding_side
    return tok(texts, padding=True, return_tensors="pt")


TEXTS = ["Write about the ocean.\nThe sea is calm.", "Describe winter.\nSnow."]


def test_causal_lm_loads_with_identical_logits(saved, tokenizer):
    path, original = saved
    model = load_causal_lm(path)
    assert not model.training
    ids = batch(tokenizer, TEXTS)
    with torch.no_grad():
        logits = model(**ids).logits
        assert logits.shape == (2, ids["input_ids"].shape[1], VOCAB)
        assert torch.equal(logits, original(**ids).logits)


def test_causal_lm_in_bfloat16(saved):
    path, _ = saved
    model = load_causal_lm(path, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_sequence_classifier_gives_one_score_per_sequence_at_the_last_real_token(saved, tokenizer):
    path, _ = saved
    model = load_sequence_classifier(path, pad_token_id=tokenizer.pad_token_id, seed=0)
    assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer.pad_token_id
    padded = batch(tokenizer, TEXTS)
    with torch.no_grad():
        scores = model(**padded).logits
        assert scores.shape == (2, 1)
        # The short text is right-padded in the batch; alone it has no padding. Same score means the
        # head reads the last real token, not a pad position (float32 batch-vs-single: 1e-5).
        alone = model(**tokenizer([TEXTS[1]], return_tensors="pt")).logits
    torch.testing.assert_close(scores[1:], alone, rtol=1e-5, atol=1e-5)


def test_sequence_classifier_head_init_follows_the_seed(saved):
    path, _ = saved
    a, b, c = (load_sequence_classifier(path, seed=s) for s in (3, 3, 4))
    assert torch.equal(a.score.weight, b.score.weight)
    assert not torch.equal(a.score.weight, c.score.weight)


def test_sequence_classifier_pad_defaults_to_the_checkpoint_then_eos(tmp_path, tokenizer):
    qwen = tiny.save_base_model(make_qwen2(tokenizer), tokenizer, tmp_path / "qwen")
    assert load_sequence_classifier(qwen).config.pad_token_id == tokenizer.pad_token_id
    gpt2 = tiny.save_base_model(make_gpt2(tokenizer), tokenizer, tmp_path / "gpt2")  # GPT-2: no pad id
    assert load_sequence_classifier(gpt2).config.pad_token_id == tokenizer.eos_token_id


def test_a_saved_reward_model_loads_back_with_the_same_scores(tmp_path, saved, tokenizer):
    path, _ = saved
    rm = load_sequence_classifier(path, pad_token_id=tokenizer.pad_token_id, seed=1)
    rm.save_pretrained(tmp_path / "rm")
    again = load_sequence_classifier(tmp_path / "rm")
    ids = batch(tokenizer, TEXTS)
    with torch.no_grad():
        assert torch.equal(rm(**ids).logits, again(**ids).logits)


def test_tokenizer_padding_side_and_missing_pad(tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path / "tok")
    assert load_tokenizer(tmp_path / "tok").padding_side == "right"
    left = load_tokenizer(tmp_path / "tok", padding_side="left")
    assert left.padding_side == "left" and left.pad_token == tiny.PAD_TOKEN
    encoded = left(TEXTS, padding=True)["input_ids"]
    assert encoded[1][0] == left.pad_token_id  # left padding: pads come first

    # A GPT-2-style tokenizer: eos only, no pad anywhere (neither in its config nor its padding setup).
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_padding()
    eos_only = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=tiny.EOS_TOKEN)
    eos_only.save_pretrained(tmp_path / "eos")
    assert AutoTokenizer.from_pretrained(tmp_path / "eos").pad_token is None
    no_pad = load_tokenizer(tmp_path / "eos")
    assert (no_pad.pad_token, no_pad.pad_token_id) == (tiny.EOS_TOKEN, tokenizer.eos_token_id)

    with pytest.raises(ValueError, match="padding_side must be one of left, right; got 'middle'"):
        load_tokenizer(tmp_path / "tok", padding_side="middle")


# --- errors -------------------------------------------------------------------------------------------


def test_missing_directory_is_named(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelDirError, match=f"{missing}: model directory not found"):
        load_causal_lm(missing)
    with pytest.raises(ModelDirError, match=f"{missing}: tokenizer directory not found"):
        load_tokenizer(missing)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelDirError, match="is a file, not a model directory"):
        load_sequence_classifier(tmp_path / "file")


def test_a_directory_without_config_or_weights_says_which_file_is_missing(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        ModelDirError, match=r"config.json is missing \(found: nothing, the directory is empty\)"
    ):
        load_causal_lm(tmp_path / "empty")
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text("{}")
    with pytest.raises(
        ModelDirError,
        match=r"no model weights: expected one of model.safetensors, "
        r"model.safetensors.index.json, .* \(found: config.json\)",
    ):
        load_sequence_classifier(tmp_path / "noweights")
    with pytest.raises(ModelDirError, match="no tokenizer files: expected one of tokenizer.json"):
        load_tokenizer(tmp_path / "noweights")


def test_unknown_dtype_lists_the_valid_ones(saved):
    path, _ = saved
    with pytest.raises(ValueError, match="unknown dtype 'fp8'; valid: float32, bfloat16, float16"):
        load_causal_lm(path, dtype="fp8")
    assert torch_dtype("float16") is torch.float16
