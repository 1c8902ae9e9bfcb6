"""The experience of one RL iteration, grouped by role with shapes, and the forward passes that fill it.

Layout: every sequence is `[left-padded prompt | right-padded response]`, so column P-1+t of the
logits predicts response token t for every row alike (P = prompt width, R = response width).
Position ids count real tokens only, so left padding does not shift RoPE positions.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

import torch
from torch import Tensor

from alignflow.config import PPOConfig
from alignflow.kernels import logprobs_and_entropy, selective_log_softmax
from alignflow.stages.common.training import llama_forward
from alignflow.stages.common.training.lora import AdaptersDisabled, unwrap_lora
from alignflow.stages.common.training.packing import ATTENTION_WIDTH, PackedRows, attention_width, pack


@dataclass
class Experience:
    """One iteration's rollouts. B = sequences (prompts x group size), R = response width."""

    # sequences
    input_ids: Tensor          # (B, P+R) long: left-padded prompt then right-padded response
    attention_mask: Tensor     # (B, P+R) long
    position_ids: Tensor       # (B, P+R) long
    response_ids: Tensor       # (B, R) long
    response_mask: Tensor      # (B, R) float: 1 on response tokens
    # policy
    rollout_logprobs: Tensor   # (B, R) from the engine (temperature-scaled, full vocabulary)
    old_logprobs: Tensor       # (B, R) recomputed by the actor before the update
    ref_logprobs: Tensor       # (B, R) frozen reference
    # critic (PPO only)
    values: Tensor | None      # (B, R) V(s_t) before each response token
    # rewards
    scores: Tensor             # (B,) combined score (reward models + functions, after shaping)
    token_rewards: Tensor      # (B, R)
    kl: Tensor                 # (B, R) per-token KL estimate to the reference
    advantages: Tensor         # (B, R)
    returns: Tensor | None     # (B, R) PPO only
    prompt_width: int = 0      # P
    # (B, R) pi_prox / pi_behaviour of an off-policy batch (losses.behaviour_weights); None on-policy
    behaviour_weights: Tensor | None = None

    @classmethod
    def of_sequences(
        cls, prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int
    ) -> Experience:
        """The sequences laid out as above, every other field zero (None for the critic's): what a forward
        needs, for tests and benchmarks of the forwards."""
        input_ids, attention_mask, position_ids, responses, mask, width_p = assemble(
            prompt_ids, response_ids, pad_id
        )
        zeros = torch.zeros_like(mask)
        return cls(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            response_ids=responses,
            response_mask=mask,
            rollout_logprobs=zeros,
            old_logprobs=zeros,
            ref_logprobs=zeros,
            values=None,
            scores=torch.zeros(len(prompt_ids)),
            token_rewards=zeros,
            kl=zeros,
            advantages=zeros,
            returns=None,
            prompt_width=width_p,
        )

    def to(self, device: torch.device | str) -> Experience:
        """The same experience with every tensor on `device` (the trained models'; the rollout is assembled on
        the CPU). Returns self when everything is there already."""
        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return Experience(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in values.items()})

    def select(self, index: Tensor) -> Experience:
        """The rows `index` (a minibatch); tensors are indexed along dim 0."""
        values = {}
        for f in fields(self):
            item = getattr(self, f.name)
            values[f.name] = item[index] if isinstance(item, Tensor) else item
        return Experience(**values)

    @cached_property
    def _packings(self) -> dict[tuple[bool, int, float | None], PackedRows]:
        return {}

    @property
    def packed(self) -> PackedRows:
        """`packing()` with its defaults."""
        return self.packing()

    def packing(
        self,
        share_prompts: bool = True,
        width_of_attention: int = ATTENTION_WIDTH,
        compact_from: float | None = None,
    ) -> PackedRows:
        """These rows packed end to end (stages/common/training/packing.py: rows with the same prompt sharing
        one copy of it unless share_prompts is off; width_of_attention, compact_from: the cost model's), for
        policy_logprobs and token_values; computed once per Experience and arguments (the reference,
        old-log-prob and value passes share it). The sequences it is computed from are never reassigned after
        construction; select and trimmed make new Experiences."""
        key = (share_prompts, width_of_attention, compact_from)
        if key not in self._packings:
            self._packings[key] = pack(
                self.input_ids,
                self.attention_mask,
                self.response_mask,
                self.prompt_width,
                share_prompts=share_prompts,
                width_of_attention=width_of_attention,
                compact_from=compact_from,
            )
        return self._packings[key]

    def trimmed(self) -> Experience:
        """The same rows without the columns that are padding in every row (left of the longest prompt,
        right of the longest response): the forward then computes on no all-padding column.

        Exact up to float summation order: the dropped columns are masked out of attention and of every
        loss. A minibatch of the demo config drops 10-30% of its columns.
        """
        real = self.attention_mask[:, : self.prompt_width].any(0)
        left = int(real.float().argmax()) if bool(real.any()) else self.prompt_width
        width_r = max(1, int(self.response_mask.sum(-1).max()))
        values = {}
        for f in fields(self):
            item = getattr(self, f.name)
            if isinstance(item, Tensor) and item.dim() == 2:
                full = item.shape[1] == self.input_ids.shape[1]
                item = item[:, left : self.prompt_width + width_r] if full else item[:, :width_r]
            values[f.name] = item
        values["prompt_width"] = self.prompt_width - left
        return Experience(**values)


def assemble(
    prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, int]:
    """(input_ids, attention_mask, position_ids, response_ids, response_mask, P) for the layout above."""
    batch = len(prompt_ids)
    width_p = max(len(p) for p in prompt_ids)
    width_r = max(1, max(len(r) for r in response_ids))
    input_ids = torch.full((batch, width_p + width_r), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width_p + width_r), dtype=torch.long)
    for row, (prompt, response) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        start = width_p - len(prompt)
        input_ids[row, start:width_p] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, start:width_p] = 1
        if response:
            input_ids[row, width_p : width_p + len(response)] = torch.tensor(response, dtype=torch.long)
            attention_mask[row, width_p : width_p + len(response)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    response = input_ids[:, width_p:]
    response_mask = attention_mask[:, width_p:].float()
    return input_ids, attention_mask, position_ids, response, response_mask, width_p


def _lean_backbone(model) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(HF model, its backbone) when llama_forward runs it exactly, else None (transformers' forward is used).

    `model` may be a training engine (DeepSpeed or PlainTorchTrainer: `.module`), a peft model or a plain HF
    model. The reference under LoRA (AdaptersDisabled) and compiled backbones keep their own forward.
    """
    if isinstance(model, AdaptersDisabled):
        return None
    hf = unwrap_lora(getattr(model, "module", model))
    backbone = getattr(hf, "base_model", None)
    if backbone is None or backbone is hf or getattr(backbone, "_compiled_call_impl", None) is not None:
        return None
    return (hf, backbone) if llama_forward.supports(backbone) is None else None


def _response_predicting(batch: int, width: int, width_p: int, device: torch.device) -> Tensor:
    """Flat indices into [batch, width] of the columns width_p - 1 .. width - 2 of every row: the positions
    whose outputs predict the response tokens (llama_forward's `keep`)."""
    columns = torch.arange(width_p - 1, width - 1, device=device)
    return (torch.arange(batch, device=device)[:, None] * width + columns).reshape(-1)


def _response_logits(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    width_p: int,
    head_on_response_only: bool = True,
    lean: bool = False,
) -> Tensor:
    """(B, R, V) logits at the columns that predict the response tokens.

    head_on_response_only: only the last R+1 positions go through the LM head (`logits_to_keep`); the
    prompt's columns would be computed and thrown away (the 2048 x 256 head of the RL benchmark model is
    ~11% of its flops). False: the whole sequence, the plain reference.
    lean: the backbone through llama_forward (fewer operator calls) where it supports the model.
    """
    resolved = _lean_backbone(model) if lean and head_on_response_only else None
    if resolved is not None:
        hf, backbone = resolved
        batch, width = input_ids.shape
        keep = _response_predicting(batch, width, width_p, input_ids.device)
        hidden = llama_forward.llama_hidden_states(
            backbone, input_ids, attention_mask, position_ids, keep=llama_forward.bucketed_keep(keep)
        )
        return hf.lm_head(hidden)[: keep.numel()].reshape(batch, width - width_p, -1)
    if not head_on_response_only:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        return logits[:, width_p - 1 : -1]
    keep = input_ids.shape[1] - width_p + 1
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=keep
    ).logits
    return logits[:, -keep:-1]


ENTROPY_MODES = ("none", "loss", "metric")


def policy_logprobs(
    model,
    exp: Experience,
    temperature: float,
    entropy: str = "none",
    head_on_response_only: bool = True,
    lean: bool = False,
    packed: PackedRows | None = None,
) -> tuple[Tensor, Tensor | None]:
    """log pi(response token) under logits / temperature, (B, R); and the entropy (B, R) if asked.

    entropy: "none"; "loss" (differentiable: the entropy bonus needs it); "metric" (no grad: for
    losses/entropy only, where a differentiable full-vocabulary entropy would be a sizeable share of a small
    model's training step). Both come from one log-softmax pass over the logits.
    packed: `exp`'s rows packed (packing.pack): where llama_forward runs the model, the forward computes on
    the packed rows and the LM head on the response-predicting positions only; else the padded layout.
    """
    if entropy not in ENTROPY_MODES:
        raise ValueError(f"entropy mode '{entropy}' is not one of {', '.join(ENTROPY_MODES)}")
    resolved = _lean_backbone(model) if packed is not None else None
    if resolved is not None:
        hf, backbone = resolved
        hidden = llama_forward.llama_hidden_states(
            backbone,
            packed.input_ids,
            packed.segment_ids,
            packed.position_ids,
            keep=llama_forward.bucketed_keep(packed.predicts),
            prefix_ids=packed.prefix_ids,
        )
        logits = _read_rows(hf.lm_head(hidden), packed.predicts.numel())  # (N, V)
        targets = exp.response_ids.reshape(-1)[packed.targets]
        if entropy == "none":
            return packed.scatter(selective_log_softmax(logits, targets, temperature=temperature)), None
        logp, ent = logprobs_and_entropy(logits, targets, temperature=temperature)
        return packed.scatter(logp), packed.scatter(ent if entropy == "loss" else ent.detach())
    logits = _response_logits(
        model,
        exp.input_ids,
        exp.attention_mask,
        exp.position_ids,
        exp.prompt_width,
        head_on_response_only,
        lean,
    )
    if entropy == "none":
        logp = selective_log_softmax(logits, exp.response_ids, temperature=temperature)
        return logp * exp.response_mask, None
    # One pass for both. As a metric the entropy is detached: its backward then skips the entropy's terms.
    logp, ent = logprobs_and_entropy(logits, exp.response_ids, temperature=temperature)
    return logp * exp.response_mask, (ent if entropy == "loss" else ent.detach()) * exp.response_mask


def _read_rows(head_out: Tensor, count: int) -> Tensor:
    """The first `count` rows of a head's output over bucketed_keep's rows: itself when nothing was padded,
    since a slice's backward writes a zero gradient of the whole output and copies into it (a [451, 2048]
    logits block: ~2 ms of the GRPO benchmark's step)."""
    return head_out if head_out.shape[0] == count else head_out[:count]


def token_values(critic, exp: Experience, lean: bool = False, packed: PackedRows | None = None) -> Tensor:
    """(B, R) critic values V(s_t) read before each response token, from a sequence-classification model.

    The critic is a separate model initialised from a reward model: its backbone's hidden states go
    through its scalar `score` head at every position, not only the last. lean, packed: as in policy_logprobs.
    """
    # The model under a training engine, then under LoRA adapters.
    model = unwrap_lora(getattr(critic, "module", critic))
    runs_lean = (lean or packed is not None) and _lean_backbone(model) is not None
    if runs_lean and packed is not None:
        hidden = llama_forward.llama_hidden_states(
            model.base_model,
            packed.input_ids,
            packed.segment_ids,
            packed.position_ids,
            keep=llama_forward.bucketed_keep(packed.predicts),
            prefix_ids=packed.prefix_ids,
        )
        return packed.scatter(_read_rows(model.score(hidden), packed.predicts.numel()).squeeze(-1).float())
    if runs_lean:
        batch, width = exp.input_ids.shape
        keep = _response_predicting(batch, width, exp.prompt_width, exp.input_ids.device)
        hidden = llama_forward.llama_hidden_states(
            model.base_model,
            exp.input_ids,
            exp.attention_mask,
            exp.position_ids,
            keep=llama_forward.bucketed_keep(keep),
        )
        return model.score(hidden)[: keep.numel()].squeeze(-1).float().reshape(batch, -1) * exp.response_mask
    hidden = model.base_model(
        input_ids=exp.input_ids, attention_mask=exp.attention_mask, position_ids=exp.position_ids
    ).last_hidden_state
    values = model.score(hidden).squeeze(-1).float()
    return values[:, exp.prompt_width - 1 : -1] * exp.response_mask


def packing_for(exp: Experience, cfg: PPOConfig, actor) -> PackedRows | None:
    """exp's rows packed for the forwards (ppo.pack_sequences, part of the fast step; rows with one prompt
    sharing it unless ppo.share_prompts is off; the row width costed for the actor's hidden size, as its
    forward runs it: llama_forward compacts rows with enough padding), else None: padded."""
    if not (cfg.fast_train_step and cfg.pack_sequences):
        return None
    width = actor_width(actor)
    return exp.packing(
        share_prompts=cfg.share_prompts,
        width_of_attention=attention_width(width),
        compact_from=llama_forward.compact_min_padding(width),
    )


def actor_width(actor) -> int:
    """The hidden size of the actor (a train engine, a LoRA-wrapped or a plain model)."""
    return unwrap_lora(getattr(actor, "module", actor)).config.hidden_size
