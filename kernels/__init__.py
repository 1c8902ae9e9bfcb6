"""Fused ops for the engine and the RL stage: per-token log-probs/entropy and sampling (not models, losses).

Each op has a torch reference (what runs on CPU) and a Triton kernel (what ``impl="auto"`` runs on
CUDA); tests compare the two in Triton's CPU interpreter. Nothing here imports triton until a
Triton kernel is actually requested.
"""

from alignflow.kernels.logprobs import entropy_from_logits, logprobs_and_entropy, selective_log_softmax
from alignflow.kernels.sampling import SampleOutput, sample_tokens

__all__ = [
    "SampleOutput",
    "entropy_from_logits",
    "logprobs_and_entropy",
    "sample_tokens",
    "selective_log_softmax",
]
