"""llama_forward gives transformers' hidden states, logits and gradients on every Llama-family variant the
native engine runs, on batches with left-padded prompts and right-padded responses (the RL layout),
and refuses what it does not run exactly.

Tolerances: fp32 max |diff| measured 2.0e-6 (hidden states) and 1.3e-6 (gradients, relative to the largest
gradient) on these models; the bounds below are ~10x that and still 1000x below what a wrong mask,
RoPE position or GQA grouping moves (>1e-2).

Models and batches are on the session's device (--device): both sides of every comparison run there.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from alignflow.stages.common.training import llama_forward
from alignflow.stages.common.training.lora import AdaptersDisabled
from alignflow.stages.ppo.experience import Experience, policy_logprobs, token_values
from tests.stages.common.generation.engine_test_models import ARCHITECTURES, random_prompts, tiny_config

HIDDEN_FP32 = 2e-5
GRAD_FP32 = 1e-5  # relative to the largest |gradient| of the parameter


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


def rl_batch(seed: int = 0, rows: int = 5, vocab: int = 256, device: str = "cpu") -> Experience:
    """Prompts of 1-13 tokens (left-padded) and responses of 0-9 tokens (right-padded), on `device`."""
    generator = torch.Generator().manual_seed(seed)
    prompts = random_prompts(rows, seed=seed, vocab=vocab)
    responses = [torch.randint(3, vocab, (int(n),), generator=generator).tolist()
                 for n in torch.randint(0, 10, (rows,), generator=generator)]
    responses[0] = torch.randint(3, vocab, (9,), generator=generator).tolist()  # one full-width response
    return Experience.of_sequences(prompts, responses, 0).to(device)


def causal_lm(name: str, seed: int = 0, device: str = "cpu", **overrides):
    """A random tiny model of variant `name`, drawn on the CPU
    (the same weights on every device), on `device`."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(name, **overrides), attn_implementation="eager")
    with torch.no_grad():  # transformers initialises biases to zero: a misplaced bias would change nothing
        for param_name, param in model.named_parameters():
            if param_name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    return model.to(device)


def loss_weights(shape, device) -> torch.Tensor:
    """Distinct weights in [-1, 1], one per position, for a loss whose gradients see every position."""
    return torch.linspace(-1, 1, int(torch.Size(shape).numel()), device=device).reshape(shape)


def grads_of(model, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(lean: dict[str, torch.Tensor], plain: dict[str, torch.Tensor]) -> None:
    assert lean.keys() == plain.keys()
    for name, grad in plain.items():
        scale = float(grad.abs().max()) or 1.0
        assert float((lean[name] - grad).abs().max()) <= GRAD_FP32 * scale, name


def assert_packed_log_probs_match_padded(model, exp: Experience, packed) -> None:
    """Log-probs, entropy and their gradients on the packed rows against transformers' padded forward."""
    weights = loss_weights(exp.response_mask.shape, exp.response_mask.device)
    logp, entropy = policy_logprobs(model, exp, 0.7, entropy="loss", lean=True, packed=packed)
    plain_logp, plain_entropy = policy_logprobs(model, exp, 0.7, entropy="loss", lean=False)
    assert float((logp - plain_logp).abs().max()) <= HIDDEN_FP32
    assert float((entropy - plain_entropy).abs().max()) <= HIDDEN_FP32
    assert_grads_close(
        grads_of(model, (logp * weights).sum() + entropy.sum()),
        grads_of(model, (plain_logp * weights).sum() + plain_entropy.sum()),
    )


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_hidden_states_and_gradients_match_transformers(name, device):
    model = causal_lm(name, device=device)
    assert llama_forward.supports(model.model) is None
    exp = rl_batch(device=device)
    real = exp.attention_mask.bool()
    plain = model.model(
        input_ids=exp.input_ids, attention_mask=exp.attention_mask, position_ids=exp.position_ids
    ).last_hidden_state
    lean = llama_forward.llama_hidden_states(model.model, exp.input_ids, exp.attention_mask, exp.position_ids)
    assert lean.shape == plain.shape
    assert float((lean - plain)[real].abs().max()) <= HIDDEN_FP32
    assert torch.isfinite(lean).all()  # padding rows attend to themselves: no NaN to leak through 0 * NaN

    # The RL loss's gradients through policy_logprobs, with and without the lean forward.
    weights = loss_weights(exp.response_mask.shape, device)
    lean_grads = grads_of(model, (policy_logprobs(model, exp, 0.7, lean=True)[0] * weights).sum())
    plain_grads = grads_of(model, (policy_logprobs(model, exp, 0.7, lean=False)[0] * weights).sum())
    assert_grads_close(lean_grads, plain_grads)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_kept_rows_equal_the_selected_rows_of_the_full_forward_with_their_gradients(name, device):
    """`keep` skips the last layer's o_proj, MLP and norm on the positions nobody reads: the kept rows and
    the gradients through them must be those of the full forward (measured equal bit for bit on these
    models; the bound allows another summation order). A row selected before the last layer's attention
    would lose its keys and values and move the result by >1e-2."""
    model = causal_lm(name, device=device)
    exp = rl_batch(seed=3, rows=6, device=device)
    packed = exp.packed
    weights = loss_weights((packed.predicts.numel(), 1), device)
    full = llama_forward.llama_hidden_states(
        model.model, packed.input_ids, packed.segment_ids, packed.position_ids
    )
    full = full.reshape(-1, full.shape[-1])[packed.predicts]
    kept = llama_forward.llama_hidden_states(
        model.model, packed.input_ids, packed.segment_ids, packed.position_ids, keep=packed.predicts
    )
    assert kept.shape == full.shape
    assert float((kept - full).abs().max()) <= HIDDEN_FP32
    assert_grads_close(grads_of(model, (kept * weights).sum()), grads_of(model, (full * weights).sum()))


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_packed_rows_give_the_padded_log_probs_entropy_and_gradients(name, device):
    """Several sequences per row (stages/common/training/packing.py), each masked to itself, against
    transformers' padded forward: a key of the wrong sequence or a position not restarted moves these by
    >1e-2."""
    model = causal_lm(name, device=device)
    exp = rl_batch(seed=2, rows=7, device=device)
    packed = exp.packed
    assert packed.input_ids.shape[0] < exp.input_ids.shape[0]  # some row holds two sequences
    assert_packed_log_probs_match_padded(model, exp, packed)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_rows_sharing_a_prompt_give_the_padded_log_probs_values_and_gradients(name, device):
    """GRPO's layout (completions of one prompt) packed with one copy of each prompt: a response that saw
    another response's tokens, or a sliding window counted in slots instead of positions (the Qwen2 and
    Mistral variants' 6- and 8-token windows), moves these by >1e-2."""
    model = causal_lm(name, device=device)
    generator = torch.Generator().manual_seed(4)
    prompts = random_prompts(3, seed=4, vocab=256)
    owners = [0, 1, 0, 2, 2, 0, 2]
    responses = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (9, 4, 7, 8, 0, 9, 3)]
    exp = Experience.of_sequences([prompts[o] for o in owners], responses, 0).to(device)
    packed = exp.packed
    assert packed.prefix_ids is not None  # prompts shared
    assert_packed_log_probs_match_padded(model, exp, packed)

    torch.manual_seed(0)
    critic = AutoModelForSequenceClassification.from_config(
        tiny_config(name, num_labels=1), attn_implementation="eager"
    ).to(device)
    values = token_values(critic, exp, packed=packed)
    plain = token_values(critic, exp, lean=False)
    assert float((values - plain).abs().max()) <= HIDDEN_FP32
    weights = loss_weights(exp.response_mask.shape, device)
    assert_grads_close(grads_of(critic, (values * weights).sum()), grads_of(critic, (plain * weights).sum()))


def test_critic_values_match_transformers(device):
    torch.manual_seed(0)
    critic = AutoModelForSequenceClassification.from_config(
        tiny_config("llama_gqa_tied_llama3", num_labels=1), attn_implementation="eager"
    ).to(device)
    exp = rl_batch(seed=1, device=device)
    plain = token_values(critic, exp, lean=False)
    lean = token_values(critic, exp, lean=True)
    assert float((lean - plain).abs().max()) <= HIDDEN_FP32
    assert_grads_close(
        grads_of(critic, lean.sum()), grads_of(critic, token_values(critic, exp, lean=False).sum())
    )
    packed = token_values(critic, exp, packed=exp.packed)
    assert float((packed - plain).abs().max()) <= HIDDEN_FP32
    assert_grads_close(
        grads_of(critic, packed.sum()), grads_of(critic, token_values(critic, exp, lean=False).sum())
    )


def test_lora_adapters_run_in_the_lean_forward_and_the_reference_keeps_transformers(device):
    from peft import LoraConfig, get_peft_model

    model = causal_lm("llama_mha_untied", device=device)
    peft_model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    )
    with torch.no_grad():  # LoRA's B starts at zero: make the adapters change the output
        for param_name, param in peft_model.named_parameters():
            if "lora_B" in param_name:
                param.normal_(0.0, 0.1)
    exp = rl_batch(seed=2, device=device)
    lean = policy_logprobs(peft_model, exp, 1.0, lean=True)[0]
    plain = policy_logprobs(peft_model, exp, 1.0, lean=False)[0]
    assert float((lean - plain).abs().max()) <= HIDDEN_FP32
    reference = policy_logprobs(AdaptersDisabled(peft_model), exp, 1.0, lean=True)[0]
    assert float((reference - lean).abs().max()) > 1e-2  # the adapters are off in the reference
    assert_grads_close(
        grads_of(peft_model, policy_logprobs(peft_model, exp, 1.0, lean=True)[0].sum()),
        grads_of(peft_model, policy_logprobs(peft_model, exp, 1.0, lean=False)[0].sum()),
    )


def test_bf16_autocast_stays_within_bf16_rounding(device):
    model = causal_lm("llama_gqa_tied_llama3", device=device)
    exp = rl_batch(seed=3, device=device)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        lean = policy_logprobs(model, exp, 1.0, lean=True)[0]
        plain = policy_logprobs(model, exp, 1.0, lean=False)[0]
    fp32 = policy_logprobs(model, exp, 1.0, lean=False)[0]
    # Both are bf16 computations of the fp32 value: neither is further from it than bf16 noise.
    bf16_noise = float((plain - fp32).abs().max())
    assert float((lean - fp32).abs().max()) <= 2 * bf16_noise + 1e-3


def test_bucketed_row_counts_add_at_most_an_eighth_and_repeat_in_8_sizes_an_octave():
    assert [llama_forward.bucketed_rows(n) for n in (1, 16, 17, 31, 33, 449, 524, 1100)] == [
        1,
        16,
        18,
        32,
        36,
        480,
        576,
        1152,
    ]
    for n in range(1, 5000):
        assert n <= llama_forward.bucketed_rows(n) <= n + n / 8
    assert len({llama_forward.bucketed_rows(n) for n in range(513, 1025)}) == 8  # 576, 640, ..., 1024


@pytest.mark.parametrize("name", ["llama_gqa_tied_llama3", "qwen2_bias_window"])
def test_rows_padded_to_a_bucket_give_the_same_log_probs_values_and_gradients(name, device):
    """The linear layers on zero-padded row counts (pad_rows, bucketed_keep): the real rows' outputs and every
    gradient as without padding (measured equal bit for bit here; the bound allows another summation order).
    A padding row that reached attention, or a repeated read-out row that kept its gradient, moves them
    >1e-2."""
    model = causal_lm(name, device=device)
    exp = rl_batch(seed=5, rows=7, device=device)
    packed = exp.packed
    weights = loss_weights((packed.predicts.numel(), 1), device)
    keep = llama_forward.bucketed_keep(packed.predicts, pad_rows=True)
    assert keep.numel() > packed.predicts.numel()  # this batch's count is not a bucket size already

    def hidden(pad: bool, keep_rows: torch.Tensor | None):
        return llama_forward.llama_hidden_states(
            model.model,
            packed.input_ids,
            packed.segment_ids,
            packed.position_ids,
            keep=keep_rows,
            prefix_ids=packed.prefix_ids,
            pad_rows=pad,
        )

    plain = hidden(False, packed.predicts)
    padded = hidden(True, keep)
    assert padded.shape[0] == keep.numel()
    padded = padded[: packed.predicts.numel()]
    assert float((padded - plain).abs().max()) <= HIDDEN_FP32
    assert_grads_close(grads_of(model, (padded * weights).sum()), grads_of(model, (plain * weights).sum()))
    full_plain, full_padded = hidden(False, None), hidden(True, None)
    assert full_padded.shape == full_plain.shape == (*packed.input_ids.shape, model.config.hidden_size)
    assert float((full_padded - full_plain).abs().max()) <= HIDDEN_FP32


@pytest.mark.cpu_only("the row padding is for CPU autocast's oneDNN kernels, compiled per shape")
def test_cpu_autocast_pads_every_linear_to_a_bucketed_row_count():
    """Under CPU autocast (bf16 matmuls through oneDNN, a kernel compiled per shape) every linear layer and
    the LM head see bucketed row counts, and the log-probs stay within bf16 rounding of the unpadded ones."""
    model = causal_lm("llama_gqa_tied_llama3")
    exp = rl_batch(seed=5, rows=7)
    seen: list[int] = []
    hooks = [
        module.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[0]))
        for module in model.modules()
        if isinstance(module, torch.nn.Linear)
    ]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        padded = policy_logprobs(model, exp, 1.0, lean=True, packed=exp.packed)[0]
    for hook in hooks:
        hook.remove()
    assert seen and all(rows == llama_forward.bucketed_rows(rows) for rows in seen)
    # The layers' rows: every position, or the real tokens where the forward compacts them.
    slots = llama_forward.compact_slots(
        exp.packed.segment_ids, exp.packed.predicts, None, model.config.hidden_size
    )
    tokens = exp.packed.input_ids.numel() if slots is None else slots.numel()
    assert {
        llama_forward.bucketed_rows(tokens),
        llama_forward.bucketed_rows(exp.packed.predicts.numel()),
    } <= set(seen)
    assert not llama_forward.pads_rows(None, torch.device("cpu"))  # outside autocast: no padding
    fp32 = policy_logprobs(model, exp, 1.0, lean=False)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        unpadded = policy_logprobs(model, exp, 1.0, lean=False)[0]
    assert float((padded - fp32).abs().max()) <= 2 * float((unpadded - fp32).abs().max()) + 1e-3


def test_refuses_what_it_does_not_run_exactly():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    assert llama_forward.supports(gpt2.transformer) is not None  # not a Llama-family backbone

    gelu = causal_lm("llama_mha_untied", hidden_act="gelu")
    assert "hidden_act" in llama_forward.supports(gelu.model)

    dropout = causal_lm("llama_mha_untied", attention_dropout=0.1)
    assert llama_forward.supports(dropout.model.eval()) is None  # no dropout in eval
    assert "attention_dropout" in llama_forward.supports(dropout.model.train())


def test_the_answer_of_supports_is_kept_per_config_and_dropped_with_it():
    """supports() checks a config once: a second model's config gets its own answer (a refused architecture
    after a supported one is still refused), and the entry goes when its config does."""
    import gc

    plain, gelu = causal_lm("llama_mha_untied"), causal_lm("llama_mha_untied", hidden_act="gelu")
    for _ in range(2):
        assert llama_forward.supports(plain.model) is None
        assert "hidden_act" in llama_forward.supports(gelu.model)
    key = id(gelu.config)
    assert key in llama_forward._UNSUPPORTED
    del gelu
    gc.collect()
    assert key not in llama_forward._UNSUPPORTED


def test_unsupported_models_fall_back_to_transformers_forward(device):
    model = causal_lm("llama_mha_untied", device=device, hidden_act="gelu")
    exp = rl_batch(seed=4, device=device)
    fallback = policy_logprobs(model, exp, 1.0, lean=True)[0]  # would raise inside llama_forward if taken
    assert torch.equal(fallback, policy_logprobs(model, exp, 1.0, lean=False)[0])

    model = causal_lm("llama_mha_untied")
    model.model.compile()  # compile_train: the compiled backbone keeps its own (compiled) forward
    from alignflow.stages.ppo.experience import _lean_backbone

    assert _lean_backbone(model) is None


def test_rope_tables_are_never_taken_from_a_dead_config_whose_id_was_reused():
    """The tables are cached by id(config) (configs are not hashable). An entry left by a collected config
    must not serve a new config that got the same id: in CI a critic was given another model's KV-head
    count."""
    import gc
    import weakref

    mha, gqa = tiny_config("llama_mha_untied"), tiny_config("llama_gqa_tied_llama3")
    spec_gqa = llama_forward._spec_and_rope(gqa, torch.device("cpu"))[0]
    # What a reused id looks like: the entry under id(mha) holds another config's spec (its config is gone).
    llama_forward._TABLES[id(mha)] = (weakref.ref(gqa), spec_gqa, *llama_forward._TABLES[id(gqa)][2:])
    spec_mha = llama_forward._spec_and_rope(mha, torch.device("cpu"))[0]
    assert (spec_mha.num_kv_heads, spec_gqa.num_kv_heads) == (4, mha.num_attention_heads // 2)

    key = id(gqa)
    del gqa
    gc.collect()
    assert key not in llama_forward._TABLES, "a collected config's entry is dropped"


@pytest.mark.parametrize("name", ["llama_gqa_tied_llama3", "qwen2_bias_window"])
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_compacted_tokens_give_every_positions_hidden_states_and_gradients(name, layout, device):
    """`compact`: the linear layers on the real tokens only, attention on the rows. The real positions'
    hidden states, the kept rows and every gradient are those of the forward over every position (within the
    bound of another summation order), padding comes out as zeros, and the
    linear layers see only real rows. A token scattered to the wrong slot, or RoPE at another token's
    position, moves them by >1e-2."""
    model = causal_lm(name, device=device)
    exp = rl_batch(seed=6, rows=7, device=device)
    if layout == "packed":
        packed = exp.packed
        ids, mask, positions = packed.input_ids, packed.segment_ids, packed.position_ids
        keep = packed.predicts
    else:  # [left-padded prompt | right-padded response], every other real position read
        ids, mask, positions = exp.input_ids, exp.attention_mask, exp.position_ids
        keep = mask.reshape(-1).nonzero().squeeze(1)[::2]
    real = mask.reshape(-1) != 0
    assert 0 < int(real.sum()) < real.numel()  # there is padding to drop

    def hidden(compact: bool, keep_rows: torch.Tensor | None, pad: bool = False):
        return llama_forward.llama_hidden_states(
            model.model, ids, mask, positions, keep=keep_rows, pad_rows=pad, compact=compact
        )

    seen: list[int] = []
    hooks = [
        module.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[0]))
        for module in model.model.modules()
        if isinstance(module, torch.nn.Linear)
    ]
    full_compact = hidden(True, None)
    for hook in hooks:
        hook.remove()
    assert set(seen) == {int(real.sum())}
    full = hidden(False, None)
    width = full.shape[-1]
    assert full_compact.shape == full.shape
    flat, flat_compact = full.reshape(-1, width), full_compact.reshape(-1, width)
    assert float((flat_compact[real] - flat[real]).abs().max()) <= HIDDEN_FP32
    assert not flat_compact[~real].any()
    weights = loss_weights((int(real.sum()), 1), device)
    assert_grads_close(
        grads_of(model, (flat_compact[real] * weights).sum()), grads_of(model, (flat[real] * weights).sum())
    )

    weights = loss_weights((keep.numel(), 1), device)
    for pad in (False, True):
        plain = hidden(False, keep)
        compacted = hidden(True, llama_forward.bucketed_keep(keep, pad), pad=pad)[: keep.numel()]
        assert float((compacted - plain).abs().max()) <= HIDDEN_FP32
        assert_grads_close(
            grads_of(model, (compacted * weights).sum()), grads_of(model, (plain * weights).sum())
        )


def test_compaction_runs_where_padding_pays_and_every_read_position_is_real():
    segments = torch.tensor([[1, 1, 2, 2, 2, 0], [3, 3, 3, 3, 0, 0]])  # 3 of 12 slots padding: 25%
    real = torch.tensor([0, 1, 2, 3, 4, 6, 7, 8, 9])
    assert torch.equal(llama_forward.compact_slots(segments, None, None, 256), real)
    assert torch.equal(llama_forward.compact_slots(segments, torch.tensor([1, 9]), True, 256), real)
    assert llama_forward.compact_slots(segments, None, False, 256) is None
    # A read position in padding (the padded layout's response columns): every position runs.
    assert llama_forward.compact_slots(segments, torch.tensor([1, 5]), None, 256) is None
    full = torch.ones(2, 6, dtype=torch.long)
    assert llama_forward.compact_slots(full, None, True, 256) is None  # nothing to drop
    # How much padding pays falls with the model's width: 25% pays at 256 wide, not at 32.
    assert llama_forward.compact_min_padding(32) > 0.25 > llama_forward.compact_min_padding(256)
    assert llama_forward.compact_slots(segments, None, None, 32) is None
    assert llama_forward.compact_slots(segments, None, True, 32) is not None  # asked for: compacted
    assert llama_forward.compact_min_padding(768) < llama_forward.compact_min_padding(256) < 0.1
