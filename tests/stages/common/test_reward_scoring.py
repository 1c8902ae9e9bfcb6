"""Reward-model scoring: read-out as in reward training, total = weighted sum of z-scores, loading checks."""

from __future__ import annotations

import json

import pytest
import torch

from alignflow.contract import StageSpec
from alignflow.manifest import publish
from alignflow.stages.common.reward_scoring import (
    RewardModel,
    combine,
    load_reward_models,
    raw_scores,
    runs_packed,
    score_with_reward_models,
)
from alignflow.stages.common.runtime import StageContext, StageInputError
from alignflow.stages.reward import score as training_score

PAD = 2


def _classifier(seed: int):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(
        vocab_size=300,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        num_labels=1,
        pad_token_id=PAD,
        bos_token_id=0,
        eos_token_id=1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForSequenceClassification(config).eval()


# Odd lengths (5, 2, 7, 1) so rows are padded differently and one batch of 3 splits them unevenly.
SEQUENCES = [[0, 5, 9, 11, 1], [0, 7], [0, 4, 4, 4, 4, 4, 8], [0]]


def test_raw_scores_match_the_reward_stage_read_out():
    model = _classifier(0)
    with torch.no_grad():
        want = training_score(model, SEQUENCES, PAD)  # one batch, as the reward stage trains and evaluates
    got = raw_scores(model, SEQUENCES, PAD, batch_size=3)
    # Same model, same padding rule; only the batch split differs: fp32 agreement to 1e-6.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # different sequences, different scores: the check above is not constant == constant
    assert got.std() > 1e-4
    with pytest.raises(ValueError, match="empty sequence"):
        raw_scores(model, [[0, 1], []], PAD)


def test_packed_llama_forward_scores_equal_transformers_padded_forward():
    model = _classifier(3)
    assert runs_packed(model, PAD)  # so the comparison below really takes the packed path
    # Trailing pad-id tokens (an EOS that doubles as the pad token) and an all-pad sequence: transformers
    # reads the last non-pad token, index 0 when there is none; the packed path must read the same positions.
    sequences = [*SEQUENCES, [0, 5, PAD, PAD], [PAD, PAD, PAD], [0, 6, PAD, 9, 1, 3, 4, 7, 8, 10, 12, 13, 14]]
    reference = raw_scores(model, sequences, PAD, batch_size=4, packed=False)
    got = raw_scores(model, sequences, PAD, batch_size=4)
    # Same arithmetic in another summation order (SDPA vs eager softmax, packed rows): fp32, measured 2e-7.
    torch.testing.assert_close(got, reference, rtol=0, atol=2e-6)
    assert reference.std() > 1e-3
    # reading [0, 5, PAD, PAD] at its last slot would differ from this
    shifted = raw_scores(model, [[0, 5]], PAD)
    torch.testing.assert_close(got[len(SEQUENCES)], shifted[0], rtol=0, atol=2e-6)
    # A config that pads with another id: transformers would read other positions, so the padded path runs.
    assert not runs_packed(model, PAD + 1)


def test_scores_under_bf16_autocast_stay_within_bf16_rounding_of_fp32():
    # The RL stage scores under its training precision (ppo.autocast): on bf16 CPUs and GPUs the reward
    # model's matmuls run in bf16. The scores stay fp32 tensors, close to the fp32 path's, and really differ
    # from them (the autocast reached the matmuls: a check of equal values would hold without it too).
    model = _classifier(5)
    sequences = [*SEQUENCES, [0, 6, 9, 1, 3, 4, 7, 8, 10, 12, 13, 14]]
    fp32 = raw_scores(model, sequences, PAD)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = raw_scores(model, sequences, PAD)
    assert bf16.dtype == torch.float32
    assert not torch.equal(bf16, fp32)
    # bf16 keeps 8 bits of mantissa: 1/256 relative per rounding, a few roundings deep in a 1-layer model.
    torch.testing.assert_close(bf16, fp32, rtol=0, atol=0.05 * float(fp32.abs().max()))
    assert fp32.std() > 1e-3


def test_total_is_the_weighted_sum_of_z_scores():
    models = [
        RewardModel("a", 1.0, 0.2, 0.5, _classifier(1)),
        RewardModel("b", -0.5, -0.1, 2.0, _classifier(2)),
    ]
    got = score_with_reward_models(models, SEQUENCES, PAD, batch_size=2)
    per_model, total = got  # unpacks like the (dict, total) pair the PPO stage uses
    for m in models:
        raw = raw_scores(m.model, SEQUENCES, PAD)
        loop = torch.tensor([(float(raw[i]) - m.mean) / m.std for i in range(len(SEQUENCES))])
        torch.testing.assert_close(per_model[m.name], loop, rtol=0, atol=1e-6)
    loop_total = torch.tensor(
        [sum(m.weight * float(per_model[m.name][i]) for m in models) for i in range(len(SEQUENCES))]
    )
    torch.testing.assert_close(total, loop_total, rtol=0, atol=1e-6)
    assert float(
        combine(models, {"a": torch.tensor([0.7]), "b": torch.tensor([1.9])}).total
    ) == pytest.approx(1.0 * (0.7 - 0.2) / 0.5 - 0.5 * (1.9 + 0.1) / 2.0)


# ----------------------------------------------------------------------------------------------
# Loading from a stage's inputs
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizers():
    from alignflow.stages.common.models.tiny import train_tokenizer

    texts = ["the ocean is lovely", "the forest is quiet", "write about music"] * 20
    return train_tokenizer(texts, 270), train_tokenizer(texts[::-1] + ["zzz yyy xxx www"] * 30, 280)


def _reward_input(tmp_path, key: str, sidecar: dict | None, tokenizer, seed: int = 0) -> str:
    folder = tmp_path / key
    _classifier(seed).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if sidecar is not None:
        (folder / "alignflow_checkpoint.json").write_text(json.dumps(sidecar))
    uri = f"file://{tmp_path}/store/{key}"
    publish(folder, uri, stage="reward", config={}, inputs={}, version="test")
    return uri


def _ctx(tmp_path, inputs: dict[str, str]) -> StageContext:
    return StageContext(
        StageSpec(
            stage="ppo",
            config={"model": {"dtype": "float32"}},
            inputs=inputs,
            output_uri=f"file://{tmp_path}/store/out",
            workdir=str(tmp_path),
        )
    )


def test_load_reward_models_reads_sidecars_in_input_order(tmp_path, tokenizers):
    tok, _ = tokenizers
    inputs = {
        "reward_z": _reward_input(
            tmp_path,
            "reward_z",
            {"name": "z", "weight": 0.5, "score_mean": 1.0, "score_std": 2.0},
            tok,
            seed=1,
        ),
        "reward_a": _reward_input(
            tmp_path,
            "reward_a",
            {"name": "a", "weight": 2.0, "score_mean": -1.0, "score_std": 0.5},
            tok,
            seed=2,
        ),
        "sft": "file:///unused",
    }
    models = load_reward_models(_ctx(tmp_path, inputs), tokenizer=tok, device="cpu")
    assert [(m.name, m.weight, m.mean, m.std) for m in models] == [
        ("a", 2.0, -1.0, 0.5),
        ("z", 0.5, 1.0, 2.0),
    ]
    assert all(not p.requires_grad for m in models for p in m.model.parameters())
    # the saved weights, not a fresh init
    torch.testing.assert_close(
        raw_scores(models[0].model, SEQUENCES, PAD),
        raw_scores(_classifier(2), SEQUENCES, PAD),
        rtol=0,
        atol=1e-6,
    )


def test_load_reward_models_refuses_bad_inputs(tmp_path, tokenizers):
    tok, other = tokenizers
    good = {"name": "rm", "weight": 1.0, "score_mean": 0.0, "score_std": 1.0}
    with pytest.raises(StageInputError, match="needs at least one 'reward_<name>' input"):
        load_reward_models(_ctx(tmp_path, {"sft": "file:///x"}))
    flat = _reward_input(tmp_path, "reward_flat", {**good, "score_std": 0.0}, tok)
    with pytest.raises(StageInputError, match="score_std=0.0"):
        load_reward_models(_ctx(tmp_path, {"reward_flat": flat}))
    bare = _reward_input(tmp_path, "reward_bare", None, tok)
    with pytest.raises(StageInputError, match="has no alignflow_checkpoint.json"):
        load_reward_models(_ctx(tmp_path, {"reward_bare": bare}))
    foreign = _reward_input(tmp_path, "reward_foreign", good, other)
    with pytest.raises(StageInputError, match="different tokenizer"):
        load_reward_models(_ctx(tmp_path, {"reward_foreign": foreign}), tokenizer=tok)
    twin = _reward_input(tmp_path, "reward_twin", good, tok)
    one = _reward_input(tmp_path, "reward_one", good, tok)
    with pytest.raises(StageInputError, match="both named 'rm'"):
        load_reward_models(_ctx(tmp_path, {"reward_one": one, "reward_twin": twin}))


# ----------------------------------------------------------------------------------------------
# Sequences sharing a prompt (GRPO's group of completions)
# ----------------------------------------------------------------------------------------------


def _grouped(prompt_lengths: list[int], owners: list[int], responses: list[list[int]], seed: int = 0):
    """(sequences, prompt lengths): prompt owners[i] followed by responses[i], random non-pad tokens."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in prompt_lengths]
    sequences = [prompts[o] + r for o, r in zip(owners, responses, strict=True)]
    return sequences, [prompt_lengths[o] for o in owners]


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# Three groups interleaved (prompts of 5, 2 and 7 tokens) and a prompt no other row has (4 tokens). Among
# the responses: empty ones (read out at the prompt's last token, in the shared copy), ones ending in
# pad-id tokens (an EOS doubling as pad: read out before them), an all-pad one (read out in the prompt).
GROUP_OWNERS = [0, 2, 1, 0, 2, 3, 2, 0, 1, 2, 0]
GROUP_RESPONSES = [
    _tokens(6, 1),
    _tokens(4, 2),
    [],
    _tokens(3, 3) + [PAD, PAD],
    [PAD, PAD, PAD],
    _tokens(5, 4),
    [],
    _tokens(1, 5),
    _tokens(7, 6) + [PAD],
    _tokens(2, 7),
    [],
]


class _Spy:
    """Records the packed inputs llama_hidden_states gets: real tokens and prefix_ids per call."""

    def __init__(self, monkeypatch):
        from alignflow.stages.common.training import llama_forward

        self.tokens: list[int] = []
        self.prefixed: list[bool] = []
        real = llama_forward.llama_hidden_states

        def spy(backbone, input_ids, segment_ids, position_ids, **kwargs):
            self.tokens.append(int((segment_ids != 0).sum()))
            self.prefixed.append(kwargs.get("prefix_ids") is not None)
            return real(backbone, input_ids, segment_ids, position_ids, **kwargs)

        monkeypatch.setattr(llama_forward, "llama_hidden_states", spy)


def test_groups_sharing_a_prompt_score_as_the_unshared_and_padded_paths(monkeypatch):
    model = _classifier(7)
    assert runs_packed(model, PAD)
    sequences, prompt_lengths = _grouped([5, 2, 7, 4], GROUP_OWNERS, GROUP_RESPONSES)
    padded = raw_scores(model, sequences, PAD, packed=False)
    unshared = raw_scores(model, sequences, PAD)
    alone = raw_scores(model, [sequences[2]], PAD)  # an empty response: its prompt alone
    spy = _Spy(monkeypatch)
    shared = raw_scores(model, sequences, PAD, prompt_lengths=prompt_lengths)
    # The same arithmetic in another layout and summation order (fp32): measured within 5e-7.
    torch.testing.assert_close(shared, padded, rtol=0, atol=1e-5)
    torch.testing.assert_close(shared, unshared, rtol=0, atol=1e-5)
    assert shared.dtype == torch.float32
    assert padded.std() > 1e-3  # scores differ: the checks above compare something
    torch.testing.assert_close(shared[2], alone[0], rtol=0, atol=1e-5)
    # The all-pad and the empty response of prompt 2 are both read at its last token: the same slot.
    assert float(shared[4]) == float(shared[6])
    # One forward (11 sequences <= batch_size) on each prompt's tokens once: 5 x 4, 2 x 2, 7 x 4 rows.
    assert spy.prefixed == [True]
    assert spy.tokens == [sum(map(len, sequences)) - 3 * 5 - 1 * 2 - 3 * 7]
    # No prompt lengths: no sharing.
    raw_scores(model, sequences, PAD)
    assert spy.tokens[-1] == sum(map(len, sequences)) and spy.prefixed[-1] is False


def test_chunks_keep_each_group_whole(monkeypatch):
    from alignflow.stages.common.reward_scoring import _group_chunks

    model = _classifier(8)
    sequences, prompt_lengths = _grouped([5, 2, 7, 4], GROUP_OWNERS, GROUP_RESPONSES, seed=1)
    # Groups of 4, 4, 2 and 1 rows in order of first appearance (prompts 0, 2, 1, 3), 4 rows a chunk.
    assert _group_chunks(sequences, prompt_lengths, 4) == [[0, 3, 7, 10], [1, 4, 6, 9], [2, 8, 5]]
    # A group larger than a chunk takes as few as it needs; then the next groups fill them.
    assert _group_chunks(sequences, prompt_lengths, 3) == [[0, 3, 7], [10], [1, 4, 6], [9, 2, 8], [5]]
    padded = raw_scores(model, sequences, PAD, packed=False)
    spy = _Spy(monkeypatch)
    shared = raw_scores(model, sequences, PAD, batch_size=4, prompt_lengths=prompt_lengths)
    torch.testing.assert_close(shared, padded, rtol=0, atol=1e-5)  # scattered back in input order
    assert len(spy.tokens) == 3 and all(spy.prefixed)
    # Shared within chunks; pack's cost model may still copy a prompt twice where that packs narrower
    # rows (here group 0's 17 tokens: one row alone and three sharing, in two 16-wide rows rather than
    # one 32-wide), so: fewer tokens, not the fewest.
    assert sum(spy.tokens) < sum(map(len, sequences)) - 3 * 7


def test_rows_with_distinct_prompts_score_as_the_unshared_path(monkeypatch):
    model = _classifier(9)
    responses = [_tokens(3, 1), [], _tokens(6, 2) + [PAD], [PAD]]
    sequences, prompt_lengths = _grouped([3, 6, 1, 4], [0, 1, 2, 3], responses, seed=2)
    padded = raw_scores(model, sequences, PAD, packed=False)
    spy = _Spy(monkeypatch)
    shared = raw_scores(model, sequences, PAD, prompt_lengths=prompt_lengths)
    torch.testing.assert_close(shared, padded, rtol=0, atol=1e-5)
    assert padded.std() > 1e-3
    assert spy.prefixed == [False] and spy.tokens == [sum(map(len, sequences))]


def test_shared_prompts_under_bf16_autocast_give_float32_scores_near_fp32():
    # The stage scores inside models.precision.forward() (bf16 CPU autocast where the CPU has bf16).
    model = _classifier(10)
    sequences, prompt_lengths = _grouped([5, 2, 7, 4], GROUP_OWNERS, GROUP_RESPONSES, seed=3)
    fp32 = raw_scores(model, sequences, PAD, packed=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        unshared = raw_scores(model, sequences, PAD)
        shared = raw_scores(model, sequences, PAD, prompt_lengths=prompt_lengths)
    assert shared.dtype == torch.float32
    assert not torch.equal(shared, fp32)  # the autocast reached the matmuls
    # bf16 keeps 8 bits of mantissa: 1/256 relative per rounding, a few roundings deep in a 1-layer model.
    scale = float(fp32.abs().max())
    torch.testing.assert_close(shared, fp32, rtol=0, atol=0.05 * scale)
    torch.testing.assert_close(shared, unshared, rtol=0, atol=0.05 * scale)
    assert fp32.std() > 1e-3


def test_prompt_lengths_are_checked_and_reach_every_reward_model(monkeypatch):
    model = _classifier(11)
    with pytest.raises(ValueError, match="2 prompt lengths for 3 sequences"):
        raw_scores(model, [[0, 1], [0], [0, 5]], PAD, prompt_lengths=[1, 1])
    with pytest.raises(ValueError, match="sequence 1 .* has prompt length 0"):
        raw_scores(model, [[0, 1], [0, 5]], PAD, prompt_lengths=[1, 0])
    with pytest.raises(ValueError, match="sequence 0 .* has prompt length 3"):
        raw_scores(model, [[0, 1], [0, 5]], PAD, prompt_lengths=[3, 1])
    models = [RewardModel("a", 1.0, 0.0, 1.0, model), RewardModel("b", 0.5, 0.0, 2.0, _classifier(12))]
    sequences, prompt_lengths = _grouped([5, 2, 7, 4], GROUP_OWNERS, GROUP_RESPONSES, seed=4)
    spy = _Spy(monkeypatch)
    got = score_with_reward_models(models, sequences, PAD, prompt_lengths=prompt_lengths)
    assert spy.prefixed == [True, True]  # both models read each prompt once
    want = score_with_reward_models(models, sequences, PAD)
    torch.testing.assert_close(got.total, want.total, rtol=0, atol=1e-5)
