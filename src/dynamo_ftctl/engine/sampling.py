"""Sampling keyed by (request seed, position): continuations reproduce exactly.

Each sampled token draws one uniform number from `uniform(seed, position)`, a
SplitMix64 hash of the pair, and inverts the CDF of the filtered distribution.
The draw for position p therefore does not depend on how many tokens were
generated before in this request, so a request for prompt + the first k
generated ids produces exactly the remaining ids of the uninterrupted run.
Temperature 0 is greedy (argmax). Logprobs are those of the raw model output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["SampleParams", "SampledToken", "sample_batch", "uniform"]

_MASK64 = (1 << 64) - 1


def uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) from (seed, position) via SplitMix64."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


@dataclass(frozen=True)
class SampleParams:
    """What one row needs to pick its token."""

    temperature: float
    top_p: float
    top_k: int  # 0 or less: no limit
    seed: int
    position: int  # absolute position of the token being generated
    num_top: int  # top alternatives to report (0: only the chosen token)


@dataclass(frozen=True)
class SampledToken:
    """The chosen token, its logprob and the top alternatives (id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def sample_batch(logits: torch.Tensor, params: Sequence[SampleParams]) -> list[SampledToken]:
    """Pick one token per row of `logits` (float32, rows × vocab)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = torch.argmax(logits, dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, dtype=torch.long, device=logits.device)
        sub = logits[rows].double()
        temps = torch.tensor([params[i].temperature for i in sampled_rows], dtype=torch.float64,
                             device=logits.device)
        sorted_logits, order = torch.sort(sub / temps[:, None], dim=-1, descending=True)
        vocab = logits.shape[-1]
        ks = torch.tensor([params[i].top_k if params[i].top_k > 0 else vocab
                           for i in sampled_rows], device=logits.device)
        rank = torch.arange(vocab, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(rank >= ks[:, None], -torch.inf)
        probs = torch.softmax(sorted_logits, dim=-1)
        top_ps = torch.tensor([params[i].top_p for i in sampled_rows], dtype=torch.float64,
                              device=logits.device)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly better tokens
        probs = probs.masked_fill((before >= top_ps[:, None]) & (rank > 0), 0.0)
        cdf = torch.cumsum(probs, dim=-1)
        draws = torch.tensor([uniform(params[i].seed, params[i].position) for i in sampled_rows],
                             dtype=torch.float64, device=logits.device)
        picks = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True).squeeze(1)
        picks = picks.clamp(max=vocab - 1)
        chosen[rows] = order.gather(1, picks[:, None]).squeeze(1)
    max_top = max((p.num_top for p in params), default=0)
    top_values = top_ids = None
    if max_top > 0:
        top_values, top_ids = torch.topk(logprobs, k=min(max_top, logits.shape[-1]), dim=-1)
    chosen_list = chosen.tolist()
    chosen_lp = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
    top_v = top_values.tolist() if top_values is not None else None
    top_i = top_ids.tolist() if top_ids is not None else None
    out = []
    for i, p in enumerate(params):
        top: tuple[tuple[int, float], ...] = ()
        if p.num_top > 0 and top_v is not None and top_i is not None:
            top = tuple(zip(top_i[i][: p.num_top], top_v[i][: p.num_top], strict=True))
        out.append(SampledToken(chosen_list[i], chosen_lp[i], top))
    return out
