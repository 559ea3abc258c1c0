"""The user code of RL, DPO and evaluation steps, on a model's returned logits, as TRL writes it
(TRL's own ``selective_log_softmax`` and ``entropy_from_logits``, imported, never copied).

    loss = grpo_loss(logits, ids, old_logps, advantages, mask, temperature=0.7)    # GRPO-style
    loss, metrics = dpo_loss(logits, reference_logits, ids, mask)                  # DPO (TRL's sigmoid loss)
    predicted = eval_argmax(logits)                                                # eval metric

Not a test module: shared by tests/lazy_logits/test_fused_steps.py and benchmarks/bench_reads.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from trl.trainer.utils import entropy_from_logits, selective_log_softmax


def tempered(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """``logits[:, :-1]`` (each position predicts the next token) at ``temperature``: a number
    divides in place (``div_``, as TRL / OpenRLHF do), a ``[B, T - 1]`` tensor out of place
    (``logits / t.clamp(min=1e-8).unsqueeze(-1)``, as verl does)."""
    logits = logits[:, :-1, :]
    if isinstance(temperature, torch.Tensor):
        return logits / temperature.clamp(min=1e-8).unsqueeze(-1)
    logits.div_(temperature)
    return logits


def token_log_probs(logits: torch.Tensor, ids: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """``[B, T - 1]`` log-probabilities of ``ids[:, 1:]`` (an old-policy or reference forward)."""
    return selective_log_softmax(tempered(logits, temperature), ids[:, 1:])


def grpo_loss(logits: torch.Tensor, ids: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, temperature: float | torch.Tensor, clip: float = 0.2,
              entropy_coef: float = 0.01) -> torch.Tensor:
    """A clipped-ratio policy loss with an entropy bonus over the masked completion tokens
    (``mask`` ``[B, T - 1]``, ``advantages`` ``[B]``)."""
    logits = tempered(logits, temperature)
    logps = selective_log_softmax(logits, ids[:, 1:])  # [B, T - 1]
    entropy = entropy_from_logits(logits)  # [B, T - 1], with grad: the bonus differentiates through it
    ratio = torch.exp(logps - old_logps)
    gain = torch.minimum(ratio * advantages[:, None], ratio.clamp(1 - clip, 1 + clip) * advantages[:, None])
    weight = mask.to(logps.dtype)
    return -((gain + entropy_coef * entropy) * weight).sum() / weight.sum()


def sequence_log_probs(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]``: the masked sum of the selected log-probabilities (TRL DPO's ``logps``)."""
    labels = ids[:, 1:].masked_fill(~mask, 0)
    per_token = selective_log_softmax(logits[:, :-1], labels)
    return (per_token * mask).sum(-1)


def dpo_loss(logits: torch.Tensor, reference_logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
             beta: float = 0.1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL's sigmoid DPO loss of a batch whose first half is chosen, second half rejected, and
    its metrics: the accuracy of ``argmax(-1)`` on the masked rows and the chosen logits' masked
    mean (``logits[mask].mean()``: the row sums of the masked rows), both fused."""
    policy = sequence_log_probs(logits, ids, mask)
    with torch.no_grad():
        reference = sequence_log_probs(reference_logits, ids, mask)
    chosen, rejected = (policy - reference).chunk(2)
    loss = -F.logsigmoid(beta * (chosen - rejected)).mean()
    half = logits.shape[0] // 2
    with torch.no_grad():
        predicted = logits[:, :-1].argmax(-1)
        metrics = {"accuracy": (predicted == ids[:, 1:])[mask].float().mean(),
                   "mean_chosen_logits": logits[:half, :-1][mask[:half]].mean()}
    return loss, metrics


def eval_argmax(logits: torch.Tensor) -> torch.Tensor:
    """What ``preprocess_logits_for_metrics`` usually returns."""
    return logits.argmax(-1)
