"""The RL trainer's shortcuts are exact where they claim to be: engine log-probs as old log-probs, old
log-probs from the first forward, minibatches trimmed of padding, the LM head on response columns only.

Each test runs the shortcut and the plain computation side by side on a tiny random Llama and
compares losses and gradients (or final weights) with tolerances stated next to them.

The engine, the models and the experience are on the session's device (--device). The critic's own thread
(ppo.overlap_critic and what builds on it) is a CPU path: its tests are cpu_only.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from alignflow.config import PPOConfig
from alignflow.stages.common.generation.interface import SamplingParams, build_engine
from alignflow.stages.common.models.loading import load_causal_lm
from alignflow.stages.common.training.deepspeed_setup import OptimSettings
from alignflow.stages.common.training.precision import resolve_precision
from alignflow.stages.ppo import losses as rl
from alignflow.stages.ppo.checkpoints import RLState
from alignflow.stages.ppo.experience import Experience, assemble, packing_for, policy_logprobs
from alignflow.stages.ppo.experience_passes import old_logprob_source
from alignflow.stages.ppo.training_loop import StaleOldLogprobs, train_on
from tests.stages.common.generation.engine_test_models import engine_config, random_prompts, save_tiny_model

PAD = 0
FP32 = resolve_precision("off", "float32", torch.device("cpu"))


class PlainTrainEngine:
    """The two calls train_on makes of a DeepSpeed engine, on a plain torch model and AdamW."""

    def __init__(self, model: torch.nn.Module, lr: float = 1e-3):
        self.module = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("shortcuts") / "llama", "llama_mha_untied")


@pytest.fixture(scope="module")
def rollout(checkpoint, device):
    """An Experience of 6 sampled responses of different lengths from the native engine (fp32), on the
    device."""
    engine = build_engine(checkpoint, engine_config(backend="native"), dtype="float32", device=device)
    prompts = random_prompts(6, seed=3)
    generation = engine.generate(
        prompts, SamplingParams(temperature=1.0, max_new_tokens=10, seeds=list(range(6)))
    )
    engine.unload()
    input_ids, attention_mask, position_ids, response_ids, mask, width_p = assemble(
        prompts, generation.response_token_ids, PAD
    )
    engine_logprobs = generation.padded(PAD)[1][:, : response_ids.shape[1]] * mask
    zeros = torch.zeros_like(mask)
    advantages = torch.linspace(-1.0, 1.0, mask.numel()).reshape(mask.shape) * mask
    return Experience(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_ids=response_ids,
        response_mask=mask,
        rollout_logprobs=engine_logprobs,
        old_logprobs=engine_logprobs.clone(),
        ref_logprobs=zeros,
        values=None,
        scores=torch.zeros(len(prompts)),
        token_rewards=zeros,
        kl=zeros,
        advantages=advantages,
        returns=None,
        prompt_width=width_p,
    ).to(device)


def loss_and_grads(model, exp: Experience) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logp, _ = policy_logprobs(model, exp, temperature=1.0)
    loss, _ = rl.policy_loss_ppo(logp, exp.old_logprobs, exp.advantages, exp.response_mask, clip_range=0.2)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def actor_model(checkpoint, device: str):
    """The checkpoint's causal LM on `device` (where the rollout is)."""
    return load_causal_lm(checkpoint).to(device)


def assert_grads_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float) -> None:
    assert a.keys() == b.keys()
    scale = max(float(g.abs().max()) for g in a.values())
    worst = max(float((a[n] - b[n]).abs().max()) for n in a)
    assert worst <= rtol * scale, f"largest gradient difference {worst:.3g} vs largest gradient {scale:.3g}"


def test_engine_logprobs_as_old_give_the_recomputed_loss_and_gradients(checkpoint, rollout, device):
    """The engine samples from the same fp32 weights the actor has: its log-probs are the recomputation's.

    Tolerance: the engine's fused GEMMs and cached keys move the last fp32 bits of the log-probs (<= 1e-4,
    the engine parity table; ~3e-6 measured), so the ratio is 1 within ~1e-5 and the loss and every
    gradient agree to 1e-4 relative; a wrong column or token would move the ratio by far more than that.
    """
    model = actor_model(checkpoint, device)
    with torch.no_grad():
        recomputed = policy_logprobs(model, rollout, temperature=1.0)[0]
    mask = rollout.response_mask
    assert float(((recomputed - rollout.rollout_logprobs).abs() * mask).max()) <= 1e-4
    engine_exp = copy.copy(rollout)
    recompute_exp = copy.copy(rollout)
    recompute_exp.old_logprobs = recomputed
    loss_engine, grads_engine = loss_and_grads(model, engine_exp)
    loss_recomputed, grads_recomputed = loss_and_grads(model, recompute_exp)
    assert math.isclose(float(loss_engine), float(loss_recomputed), rel_tol=1e-4, abs_tol=1e-7)
    assert_grads_close(grads_engine, grads_recomputed, rtol=1e-4)


def test_trimmed_minibatch_gives_the_padded_loss_and_gradients(checkpoint, rollout, device):
    """Columns that are padding in every row of a minibatch change nothing but float summation order."""
    model = actor_model(checkpoint, device)
    lengths = rollout.response_mask.sum(-1)
    prompt_lengths = rollout.attention_mask[:, : rollout.prompt_width].sum(-1)
    # The rows with the shortest prompts and responses: their minibatch has padding columns at both ends.
    rows = torch.argsort(lengths + prompt_lengths)[:3]
    padded = rollout.select(rows)
    trimmed = padded.trimmed()
    assert trimmed.input_ids.shape[1] < padded.input_ids.shape[1]
    assert (
        trimmed.prompt_width < padded.prompt_width
        or trimmed.response_ids.shape[1] < padded.response_ids.shape[1]
    )
    assert int(trimmed.response_mask.sum()) == int(padded.response_mask.sum())
    loss_padded, grads_padded = loss_and_grads(model, padded)
    loss_trimmed, grads_trimmed = loss_and_grads(model, trimmed)
    # fp32 sums over different widths: measured ~1e-7 relative; 1e-5 still catches a shifted column (~1e-1).
    assert math.isclose(float(loss_padded), float(loss_trimmed), rel_tol=1e-5, abs_tol=1e-7)
    assert_grads_close(grads_padded, grads_trimmed, rtol=1e-5)


def test_trimmed_drops_only_all_padding_columns(rollout):
    trimmed = rollout.trimmed()
    left = rollout.prompt_width - trimmed.prompt_width
    assert not rollout.attention_mask[:, :left].any()
    width_r = trimmed.response_ids.shape[1]
    assert not rollout.response_mask[:, width_r:].any()
    assert torch.equal(trimmed.input_ids, rollout.input_ids[:, left : rollout.prompt_width + width_r])
    assert torch.equal(trimmed.old_logprobs, rollout.old_logprobs[:, :width_r])


def test_lm_head_on_response_columns_equals_the_full_forward(checkpoint, rollout, device):
    model = actor_model(checkpoint, device)
    with torch.no_grad():
        full = model(
            input_ids=rollout.input_ids,
            attention_mask=rollout.attention_mask,
            position_ids=rollout.position_ids,
        ).logits[:, rollout.prompt_width - 1 : -1]
        logp_full = torch.log_softmax(full, -1).gather(-1, rollout.response_ids[..., None])[..., 0]
        logp = policy_logprobs(model, rollout, temperature=1.0)[0]
    assert torch.allclose(logp, logp_full * rollout.response_mask, atol=1e-5)


def trainer_settings(micro_batch_size: int) -> OptimSettings:
    """The plain torch trainer's settings for these tests: AdamW at 1e-3, clipped at 1, no schedule."""
    return OptimSettings(
        lr=1e-3,
        weight_decay=0.0,
        warmup_steps=0,
        total_steps=8,
        micro_batch_size=micro_batch_size,
        grad_accum=1,
        zero_stage=0,
        grad_clip=1.0,
        schedule="constant",
    )


def ppo_config(**overrides) -> PPOConfig:
    values = dict(
        algorithm="grpo",
        group_size=2,
        prompts_per_iteration=3,
        minibatch_size=6,
        ppo_epochs=2,
        kl_coef=0.0,
        clip_range=0.2,
        seed=0,
    )
    values.update(overrides)
    return PPOConfig(**values)


def test_old_logprobs_from_the_first_forward_train_exactly_like_the_recomputation(
    checkpoint, rollout, device
):
    """One minibatch holding every row: its first forward is taken at the weights a recomputation would
    use, so two epochs of training end at the same weights (to float determinism: bit-equal here)."""
    cfg = ppo_config()
    recompute_actor = PlainTrainEngine(actor_model(checkpoint, device))
    first_forward_actor = PlainTrainEngine(actor_model(checkpoint, device))
    recompute_exp, first_exp = copy.copy(rollout), copy.copy(rollout)
    with torch.no_grad():  # the stage's recomputation: the fast step's forward (lean, packed)
        recompute_exp.old_logprobs = policy_logprobs(
            recompute_actor.module,
            rollout,
            temperature=1.0,
            lean=True,
            packed=packing_for(rollout, cfg, recompute_actor),
        )[0]
    first_exp.old_logprobs = torch.full_like(rollout.old_logprobs, float("nan"))  # must be overwritten
    metrics_a = train_on(recompute_exp, recompute_actor, None, cfg, 0.0, 1, FP32)
    metrics_b = train_on(first_exp, first_forward_actor, None, cfg, 0.0, 1, FP32, old_from_first_forward=True)
    assert torch.allclose(first_exp.old_logprobs, recompute_exp.old_logprobs, atol=1e-6)
    for key in ("losses/policy_loss", "losses/approx_kl", "losses/clipfrac"):
        assert metrics_a[key] == pytest.approx(metrics_b[key], rel=1e-5, abs=1e-8)
    for (name, a), (_, b) in zip(
        recompute_actor.module.named_parameters(), first_forward_actor.module.named_parameters(), strict=True
    ):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), name


def test_first_forward_needs_one_minibatch_of_every_row(checkpoint, rollout, device):
    actor = PlainTrainEngine(actor_model(checkpoint, device))
    with pytest.raises(ValueError, match="one minibatch holding every row"):
        train_on(
            copy.copy(rollout),
            actor,
            None,
            ppo_config(minibatch_size=2),
            0.0,
            1,
            FP32,
            old_from_first_forward=True,
        )


def test_engine_logprobs_off_by_more_than_the_tolerance_stop_before_any_step(checkpoint, rollout, device):
    """`auto`'s check: a 1e-2 disagreement (a bf16 engine, say) raises before the optimizer moves anything."""
    actor = PlainTrainEngine(actor_model(checkpoint, device))
    before = {n: p.detach().clone() for n, p in actor.module.named_parameters()}
    stale = copy.copy(rollout)
    stale.old_logprobs = rollout.rollout_logprobs + 1e-2 * rollout.response_mask
    with pytest.raises(StaleOldLogprobs) as caught:
        train_on(stale, actor, None, ppo_config(), 0.0, 1, FP32, check_old_tolerance=1e-4)
    assert caught.value.measured == pytest.approx(1e-2, rel=0.05)
    for name, param in actor.module.named_parameters():
        assert torch.equal(param, before[name]), f"{name} moved before the check"
    metrics = train_on(
        copy.copy(rollout),
        PlainTrainEngine(actor_model(checkpoint, device)),
        None,
        ppo_config(),
        0.0,
        1,
        FP32,
        check_old_tolerance=1e-4,
    )
    assert metrics["rollout/logprob_engine_vs_actor_max"] <= 1e-4


PPO_KL = {"algorithm": "ppo", "group_size": 1, "prompts_per_iteration": 6, "kl_coef": 0.1}


@pytest.mark.parametrize(
    ("overrides", "autocast", "fallback", "values_first", "expected"),
    [
        ({"old_logprobs": "auto"}, False, False, False, "engine"),
        # fell back once: recompute, here for free
        ({"old_logprobs": "auto"}, False, True, False, "first_forward"),
        # GRPO's KL is a term of the loss: it can wait for the first forward
        ({"old_logprobs": "auto", "kl_coef": 0.1}, False, True, False, "first_forward"),
        # PPO's KL in the reward shapes the advantages, needed before training unless they wait for the
        # critic's first forward (values_first) anyway
        ({"old_logprobs": "auto", **PPO_KL}, False, True, False, "recompute"),
        ({"old_logprobs": "auto", **PPO_KL}, False, True, True, "first_forward"),
        ({"old_logprobs": "auto", **PPO_KL, "kl_in_reward": False}, False, True, False, "first_forward"),
        # autocast is not the engine's dtype
        ({"old_logprobs": "auto"}, True, False, False, "first_forward"),
        ({"old_logprobs": "auto", "minibatch_size": 2}, True, False, False, "recompute"),
        ({"old_logprobs": "auto", **PPO_KL, "minibatch_size": 2}, True, False, True, "recompute"),
        ({"old_logprobs": "engine"}, True, True, False, "engine"),
        # the engine samples from bf16-rounded weights (engine.cpu_linear_weights)
        ({"old_logprobs": "auto"}, None, False, False, "first_forward"),
        ({"old_logprobs": "auto", "minibatch_size": 2}, None, False, False, "recompute"),
        ({"old_logprobs": "recompute"}, False, False, False, "first_forward"),
    ],
)
def test_old_logprob_source(overrides, autocast, fallback, values_first, expected):
    """autocast None: no autocast, and an engine that rounds the weights."""
    cfg = ppo_config(**overrides)
    state = RLState(cfg)
    state.old_logprobs_fallback = fallback
    precision = resolve_precision("bf16" if autocast else "off", "float32", torch.device("cpu"))
    source = old_logprob_source(cfg, precision, state, rows=6, values_first=values_first,
                                engine_exact=autocast is not None)
    assert source == expected


@pytest.mark.slow
def test_compiled_training_step_equals_eager(checkpoint, rollout, device):
    """ppo.compile_train: the backbone compiled in place gives eager's loss and gradients, and keeps its keys.

    Tolerance: inductor fuses and reorders fp32 sums; measured ~1e-6 relative on this model; 1e-4 catches a
    wrong mask or position (>1e-2).
    """
    eager = actor_model(checkpoint, device)
    compiled = actor_model(checkpoint, device)
    compiled.base_model.compile(dynamic=True)
    assert list(compiled.state_dict()) == list(eager.state_dict())
    for rows in ([0, 1, 2], [3, 4, 5, 1]):  # two shapes: the dynamic graph serves both
        exp = rollout.select(torch.tensor(rows)).trimmed()
        loss_eager, grads_eager = loss_and_grads(eager, exp)
        loss_compiled, grads_compiled = loss_and_grads(compiled, exp)
        assert math.isclose(float(loss_eager), float(loss_compiled), rel_tol=1e-4, abs_tol=1e-7)
        assert_grads_close(grads_eager, grads_compiled, rtol=1e-4)


@pytest.mark.cpu_only("the critic's own thread (ppo.overlap_critic) is for models on the CPU")
def test_critic_on_its_own_thread_trains_exactly_like_one_after_the_other(checkpoint, rollout):
    """ppo.overlap_critic: the critic's updates on a second thread, each thread with half the torch threads,
    end at the same actor and critic weights and the same metrics as the sequential loop (2 epochs x 2
    minibatches, PPO with a critic, the plain torch trainer as one rank at ZeRO 0 runs it); the stage's thread
    count is restored."""
    from alignflow.stages.common.models.loading import load_sequence_classifier
    from alignflow.stages.common.training.plain_trainer import PlainTorchTrainer
    from alignflow.stages.ppo.critic_schedule import overlaps_critic

    exp = copy.copy(rollout)
    noise = torch.Generator().manual_seed(0)
    exp.values = torch.randn(exp.response_mask.shape, generator=noise) * exp.response_mask
    exp.returns = torch.randn(exp.response_mask.shape, generator=noise) * exp.response_mask
    torch.manual_seed(0)
    critic_init = load_sequence_classifier(checkpoint, pad_token_id=PAD)
    settings = trainer_settings(micro_batch_size=3)
    torch.set_num_threads(2)  # one thread each (the autouse fixture restores 1 after the test)
    runs = {}
    for overlap in (False, True):
        actor = PlainTorchTrainer(load_causal_lm(checkpoint), settings)
        critic = PlainTorchTrainer(copy.deepcopy(critic_init), settings)
        cfg = ppo_config(
            algorithm="ppo", group_size=1, prompts_per_iteration=6, minibatch_size=3, overlap_critic=overlap
        )
        assert overlaps_critic(actor, critic, cfg) is overlap
        runs[overlap] = (train_on(copy.copy(exp), actor, critic, cfg, 0.0, 1, FP32), actor, critic)
        assert torch.get_num_threads() == 2
    (sequential, actor_a, critic_a), (overlapped, actor_b, critic_b) = runs[False], runs[True]
    assert "losses/value_loss" in sequential and sequential == overlapped
    for a, b in ((actor_a, actor_b), (critic_a, critic_b)):
        for (name, x), (_, y) in zip(a.module.named_parameters(), b.module.named_parameters(), strict=True):
            assert torch.equal(x, y), name


@pytest.mark.cpu_only("the critic's own thread (ppo.overlap_critic) is for models on the CPU")
def test_stale_old_logprobs_stop_the_critics_thread_before_any_step(checkpoint, rollout):
    """The critic's thread starts its updates before the actor's check of the old log-probs: when the check
    fails neither model moves (the critic's gradients are dropped, its queued updates never step), and the
    same models then train normally."""
    from alignflow.stages.common.models.loading import load_sequence_classifier
    from alignflow.stages.common.training.plain_trainer import PlainTorchTrainer
    from alignflow.stages.ppo.critic_schedule import overlaps_critic

    exp = copy.copy(rollout)
    noise = torch.Generator().manual_seed(0)
    exp.values = torch.randn(exp.response_mask.shape, generator=noise) * exp.response_mask
    exp.returns = torch.randn(exp.response_mask.shape, generator=noise) * exp.response_mask
    settings = trainer_settings(micro_batch_size=3)
    torch.set_num_threads(2)  # one thread each (the autouse fixture restores 1 after the test)
    actor = PlainTorchTrainer(load_causal_lm(checkpoint), settings)
    critic = PlainTorchTrainer(load_sequence_classifier(checkpoint, pad_token_id=PAD), settings)
    cfg = ppo_config(algorithm="ppo", group_size=1, prompts_per_iteration=6, minibatch_size=3)
    assert overlaps_critic(actor, critic, cfg)
    before = {
        f"{who}.{n}": p.detach().clone()
        for who, m in (("actor", actor), ("critic", critic))
        for n, p in m.module.named_parameters()
    }
    stale = copy.copy(exp)
    stale.old_logprobs = exp.rollout_logprobs + 1e-2 * exp.response_mask
    with pytest.raises(StaleOldLogprobs):
        train_on(stale, actor, critic, cfg, 0.0, 1, FP32, check_old_tolerance=1e-4)
    for who, model in (("actor", actor), ("critic", critic)):
        for name, param in model.module.named_parameters():
            assert torch.equal(param, before[f"{who}.{name}"]), f"{who}.{name} moved before the check"
            assert param.grad is None, f"{who}.{name} kept a gradient"
    assert torch.get_num_threads() == 2
    metrics = train_on(copy.copy(exp), actor, critic, cfg, 0.0, 1, FP32, check_old_tolerance=1e-4)
    assert metrics["rollout/logprob_engine_vs_actor_max"] <= 1e-4 and "losses/value_loss" in metrics
    name, param = next(critic.module.named_parameters())
    assert not torch.equal(param, before[f"critic.{name}"]), "the critic did not train after the failed check"


@pytest.mark.cpu_only("the critic's own thread (ppo.overlap_critic) is for models on the CPU")
def test_values_from_the_critics_first_forward_train_like_the_values_pass(checkpoint, rollout):
    """values_from_first_forward: one minibatch holding every row, the critic on its own thread. Its first
    training forward gives the values (and so the advantages and returns) that the no-grad values pass gives,
    and the two ways train the actor and the critic to the same weights (2 epochs; fp32, 1e-6: float
    order)."""
    from alignflow.stages.common.models.loading import load_sequence_classifier
    from alignflow.stages.common.training.plain_trainer import PlainTorchTrainer
    from alignflow.stages.ppo.critic_schedule import values_from_first_forward
    from alignflow.stages.ppo.experience import token_values
    from alignflow.stages.ppo.scoring import advantages_for

    settings = trainer_settings(micro_batch_size=6)
    cfg = ppo_config(algorithm="ppo", group_size=1, prompts_per_iteration=6, minibatch_size=6)
    torch.manual_seed(0)
    critic_init = load_sequence_classifier(checkpoint, pad_token_id=PAD)
    torch.set_num_threads(2)  # one thread each (the autouse fixture restores 1 after the test)
    runs = {}
    for first in (False, True):
        actor = PlainTorchTrainer(load_causal_lm(checkpoint), settings)
        critic = PlainTorchTrainer(copy.deepcopy(critic_init), settings)
        assert values_from_first_forward(actor, critic, cfg, 6)
        exp = copy.copy(rollout)
        exp.scores = torch.linspace(-1.0, 2.0, 6)
        if first:
            metrics = train_on(
                exp,
                actor,
                critic,
                cfg,
                0.0,
                1,
                FP32,
                advantages_after_values=lambda e: advantages_for(e, cfg, 0.0),
            )
        else:
            with torch.no_grad():
                exp.values = token_values(critic.module, exp, lean=True, packed=packing_for(exp, cfg, actor))
            advantages_for(exp, cfg, 0.0)
            metrics = train_on(exp, actor, critic, cfg, 0.0, 1, FP32)
        runs[first] = (exp, metrics, actor, critic)
    (exp_a, metrics_a, actor_a, critic_a), (exp_b, metrics_b, actor_b, critic_b) = runs[False], runs[True]
    for name in ("values", "advantages", "returns"):
        assert torch.allclose(getattr(exp_a, name), getattr(exp_b, name), atol=1e-6, rtol=0), name
    assert float(exp_b.values.abs().sum()) > 0
    for key in ("losses/value_loss", "losses/policy_loss"):
        assert metrics_a[key] == pytest.approx(metrics_b[key], rel=1e-5, abs=1e-7), key
    for a, b in ((actor_a, actor_b), (critic_a, critic_b)):
        for (name, x), (_, y) in zip(a.module.named_parameters(), b.module.named_parameters(), strict=True):
            assert torch.allclose(x, y, atol=1e-6, rtol=0), name


@pytest.mark.cpu_only("the critic's own thread (ppo.overlap_critic) is for models on the CPU")
@pytest.mark.slow
def test_ppo_kl_in_the_reward_from_the_first_forwards_trains_like_the_recomputation(checkpoint, rollout):
    """PPO, KL in the reward, one minibatch of every row, the critic on its own thread: the stage takes the
    old log-probs from the actor's first forward and the values from the critic's, then the KL (which reads
    the old log-probs), the token rewards and the advantages (stage.kl_later). The same as the no-grad
    old-log-prob and values passes before training: KL, advantages, returns, losses and both models' weights
    (2 epochs; fp32, 1e-6: float order)."""
    from alignflow.stages.common.models.loading import load_sequence_classifier
    from alignflow.stages.common.training.plain_trainer import PlainTorchTrainer
    from alignflow.stages.ppo.experience import token_values
    from alignflow.stages.ppo.scoring import kl_and_advantages

    kl_coef = 0.2
    settings = trainer_settings(micro_batch_size=6)
    cfg = ppo_config(
        algorithm="ppo", group_size=1, prompts_per_iteration=6, minibatch_size=6, kl_coef=kl_coef
    )
    torch.manual_seed(0)
    critic_init = load_sequence_classifier(checkpoint, pad_token_id=PAD)
    # A reference other than the actor, so that the KL is not zero: the engine's log-probs shifted per token.
    shift = torch.linspace(-0.3, 0.5, rollout.response_mask.numel()).view_as(rollout.response_mask)
    reference_logprobs = (rollout.rollout_logprobs + shift) * rollout.response_mask
    torch.set_num_threads(2)  # one thread each (the autouse fixture restores 1 after the test)
    runs = {}
    for first in (False, True):
        actor = PlainTorchTrainer(load_causal_lm(checkpoint), settings)
        critic = PlainTorchTrainer(copy.deepcopy(critic_init), settings)
        exp = copy.copy(rollout)
        exp.scores = torch.linspace(-1.0, 2.0, 6)
        exp.ref_logprobs = reference_logprobs
        if first:
            exp.old_logprobs = torch.full_like(rollout.old_logprobs, float("nan"))  # must be overwritten
            metrics = train_on(exp, actor, critic, cfg, kl_coef, 1, FP32, old_from_first_forward=True,
                               advantages_after_values=lambda e: kl_and_advantages(e, cfg, kl_coef, True, 1))
        else:
            packed = packing_for(exp, cfg, actor)
            with torch.no_grad():
                exp.old_logprobs = policy_logprobs(actor.module, exp, 1.0, lean=True, packed=packed)[0]
                exp.values = token_values(critic.module, exp, lean=True, packed=packed)
            kl_and_advantages(exp, cfg, kl_coef, True, 1)
            metrics = train_on(exp, actor, critic, cfg, kl_coef, 1, FP32)
        runs[first] = (exp, metrics, actor, critic)
    (exp_a, metrics_a, actor_a, critic_a), (exp_b, metrics_b, actor_b, critic_b) = runs[False], runs[True]
    assert float((exp_a.kl * exp_a.response_mask).abs().sum()) > 0.1  # a KL there is, shaping the rewards
    for name in ("old_logprobs", "kl", "values", "token_rewards", "advantages", "returns"):
        assert torch.allclose(getattr(exp_a, name), getattr(exp_b, name), atol=1e-6, rtol=0), name
    for key in ("losses/value_loss", "losses/policy_loss", "losses/approx_kl"):
        assert metrics_a[key] == pytest.approx(metrics_b[key], rel=1e-5, abs=1e-7), key
    for a, b in ((actor_a, actor_b), (critic_a, critic_b)):
        for (name, x), (_, y) in zip(a.module.named_parameters(), b.module.named_parameters(), strict=True):
            assert torch.allclose(x, y, atol=1e-6, rtol=0), name


@pytest.mark.cpu_only("the critic's own thread (ppo.overlap_critic) is for models on the CPU")
def test_values_come_from_the_first_forward_only_where_it_is_the_values_pass(checkpoint):
    """Not with several minibatches (later ones see an updated critic), without the critic's thread, or with
    dropout in the critic (its training forward would differ from the no-grad pass)."""
    from alignflow.stages.common.models.loading import load_sequence_classifier
    from alignflow.stages.common.training.plain_trainer import PlainTorchTrainer
    from alignflow.stages.ppo.critic_schedule import values_from_first_forward

    settings = trainer_settings(micro_batch_size=6)
    actor = PlainTorchTrainer(load_causal_lm(checkpoint), settings)
    critic = PlainTorchTrainer(load_sequence_classifier(checkpoint, pad_token_id=PAD), settings)
    cfg = ppo_config(algorithm="ppo", group_size=1, prompts_per_iteration=6, minibatch_size=6)
    torch.set_num_threads(2)
    assert values_from_first_forward(actor, critic, cfg, 6)
    assert not values_from_first_forward(actor, critic, cfg, 12)
    assert not values_from_first_forward(
        actor, critic, ppo_config(algorithm="ppo", minibatch_size=6, overlap_critic=False), 6
    )
    assert not values_from_first_forward(
        actor, critic, ppo_config(algorithm="ppo", minibatch_size=6, fast_train_step=False), 6
    )
    critic.module.config.attention_dropout = 0.1
    assert not values_from_first_forward(actor, critic, cfg, 6)
    torch.set_num_threads(1)
    critic.module.config.attention_dropout = 0.0
    assert not values_from_first_forward(actor, critic, cfg, 6)  # one thread: no critic's thread


@pytest.mark.cpu_only("the critic's own thread (ppo.overlap_critic) is for models on the CPU")
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_a_pass_on_the_critics_thread_gives_what_it_gives_in_line(checkpoint, rollout, monkeypatch, kl_coef):
    """ppo.overlap_critic in experience_passes: one pass runs on the critic's thread beside the scoring and
    the others (the reference's with a KL term, else the critic's; wrappers of the passes see which thread ran
    them), and every result equals the in-line run's bit for bit (the same forwards, one torch thread each);
    the stage's thread count is restored."""
    import threading

    from alignflow.stages.common.models.loading import load_sequence_classifier
    from alignflow.stages.common.profiler import Profiler
    from alignflow.stages.common.training.plain_trainer import PlainTorchTrainer
    from alignflow.stages.ppo import experience_passes as passes
    from alignflow.stages.ppo.critic_schedule import overlaps_critic, overlaps_passes
    from alignflow.stages.ppo.experience_passes import experience_passes

    settings = OptimSettings(
        lr=1e-3,
        weight_decay=0.0,
        warmup_steps=0,
        total_steps=1,
        micro_batch_size=6,
        grad_accum=1,
        zero_stage=0,
        grad_clip=1.0,
        schedule="constant",
    )
    actor = PlainTorchTrainer(load_causal_lm(checkpoint), settings)
    torch.manual_seed(0)
    critic = PlainTorchTrainer(load_sequence_classifier(checkpoint, pad_token_id=PAD), settings)
    reference = load_causal_lm(checkpoint)
    with torch.no_grad():  # a reference unlike the actor, so that mixing the two up would show
        for weight in reference.parameters():
            weight.mul_(0.9)
    ran_on: list[tuple[str, bool]] = []  # (pass, on the critic's thread)

    def watched(name, function):
        def run(model, *args, **kwargs):
            who = "reference" if model is reference else name
            ran_on.append((who, threading.current_thread().name.startswith("critic")))
            return function(model, *args, **kwargs)

        return run

    monkeypatch.setattr(passes, "token_values", watched("values", passes.token_values))
    monkeypatch.setattr(passes, "policy_logprobs", watched("old_logprobs", passes.policy_logprobs))
    torch.set_num_threads(2)  # one thread each (the autouse fixture restores 1 after the test)
    runs = {}
    for overlap in (False, True):
        cfg = ppo_config(
            algorithm="ppo", group_size=1, prompts_per_iteration=6, kl_coef=kl_coef, overlap_critic=overlap
        )
        assert overlaps_critic(actor, critic, cfg) is overlap
        assert overlaps_passes(actor, critic, cfg) is overlap  # auto: the 64-wide actor is narrower than 256
        exp = copy.copy(rollout)
        profiler = Profiler("test")
        ran_on.clear()
        scored = experience_passes(
            exp,
            cfg,
            actor,
            critic,
            reference,
            FP32,
            "recompute",
            profiler,
            lambda: threading.current_thread().name,
        )
        assert scored == threading.current_thread().name  # score() runs here, its result returned
        assert torch.get_num_threads() == 2
        passes = {"values", "old_logprobs"} | ({"reference"} if kl_coef else set())
        assert set(profiler.phase_totals) == passes | {"score"}
        beside = {"reference" if kl_coef else "values"} if overlap else set()
        assert sorted(ran_on) == sorted((name, name in beside) for name in passes)
        runs[overlap] = exp
    in_line, overlapped = runs[False], runs[True]
    for name in ("values", "ref_logprobs", "old_logprobs"):
        assert torch.equal(getattr(in_line, name), getattr(overlapped, name)), name
        assert not getattr(overlapped, name).requires_grad, name  # no_grad is per thread: set on each
    assert float((in_line.values * in_line.response_mask).abs().sum()) > 0
    if kl_coef:
        assert not torch.equal(in_line.ref_logprobs, in_line.old_logprobs)
    wide = ppo_config(algorithm="ppo", group_size=1, prompts_per_iteration=6)
    assert not overlaps_passes(actor, critic, wide.model_copy(update={"overlap_passes": "off"}))
    # bound by arithmetic: auto keeps them in line
    monkeypatch.setattr(actor.module.config, "hidden_size", 256)
    assert overlaps_critic(actor, critic, wide) and not overlaps_passes(actor, critic, wide)
    assert overlaps_passes(actor, critic, wide.model_copy(update={"overlap_passes": "on"}))


@pytest.mark.parametrize("packed", [False, True])
def test_entropy_as_a_metric_comes_detached_and_leaves_the_gradients_alone(
    checkpoint, rollout, packed, device
):
    """'metric' takes the entropy from the log-probs' own pass: the same values as 'loss' gives, no gradient
    through it, and the log-probs' gradients those of 'none' (bit for bit: the same backward)."""
    model = actor_model(checkpoint, device)
    layout = rollout.packed if packed else None
    weights = torch.linspace(-1.0, 1.0, rollout.response_mask.numel(), device=device).reshape(
        rollout.response_mask.shape
    )
    grads = {}
    for mode in ("none", "metric"):
        model.zero_grad(set_to_none=True)
        logp, entropy = policy_logprobs(model, rollout, 0.7, entropy=mode, lean=True, packed=layout)
        (logp * weights).sum().backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        if mode == "metric":
            assert not entropy.requires_grad
            with torch.no_grad():
                want = policy_logprobs(model, rollout, 0.7, entropy="loss", lean=True, packed=layout)[1]
            assert torch.equal(entropy, want)
            assert float(entropy.sum()) > 0
    for name, grad in grads["none"].items():
        assert torch.equal(grad, grads["metric"][name]), name
