"""Verifying drafts in one forward, exactly (speculative decoding's check, ``speculative``).

``verify_batch`` lays out the forward: every running row feeds its next input and its draft at
its own positions and cache columns. ``accept_drafts`` applies the acceptance rule to the
log-probs that forward gives (Leviathan et al., 2023, for a deterministic draft): greedy keeps
a draft token while it equals the argmax, so the outputs are those of plain decoding; sampling
keeps draft ``d`` with probability ``p(d)`` and, on rejection, samples from ``p`` with ``d``
removed, so every token follows the plain sampling distribution. Each emitted token's log-prob
is the one plain decoding reports for it.

Examples:
    >>> import torch
    >>> logp = torch.log_softmax(torch.tensor([[[0.0, 3.0], [2.0, 0.0]]]), dim=-1)
    >>> accept_drafts(logp, [[1]], greedy=True, rng=torch.Generator())[0]  # 1 kept, then 0
    [[1, 0]]
"""

from __future__ import annotations

import torch


def verify_batch(
    lengths: list[int],
    next_inputs: list[int],
    drafts: list[list[int]],
    *,
    pad_token_id: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs of the forward that verifies every row's draft at once.

    Row ``i`` feeds its next input and its draft (``1 + k_i`` tokens) at its own positions
    ``lengths[i], lengths[i] + 1, ...``, padded to the longest row; each query sees its row's
    columns up to its own. Its keys and values land in those columns: those of rejected draft
    tokens stay masked until later tokens overwrite them. Padding queries write the columns past
    a row's draft (the cache keeps ``draft_tokens`` spare columns per row for them), repeat the
    row's last position (never past the context) and are never read.

    Args:
        lengths: each row's filled cache columns (the position of its next input).
        next_inputs: each row's last emitted token, not yet fed to the model.
        drafts: each row's draft (may be empty).
        pad_token_id: filler of padding queries.
        device: the model's device.

    Returns:
        ``(ids, positions, columns, allowed)``: ``[batch, width]`` input ids, their position
        ids and the cache columns they are written to, and ``[batch, width, kv]`` the columns
        each query sees.
    """
    width = 1 + max(map(len, drafts))
    rows = [[first, *draft] for first, draft in zip(next_inputs, drafts, strict=True)]
    ids = torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows], device=device)
    start = torch.tensor(lengths, device=device)
    columns = start[:, None] + torch.arange(width, device=device)  # [batch, width]
    last = start + torch.tensor([len(d) for d in drafts], device=device)
    positions = torch.minimum(columns, last[:, None])
    kv_len = max(lengths) + width
    allowed = torch.arange(kv_len, device=device)[None, None, :] <= columns[:, :, None]
    return ids, positions, columns, allowed


def accept_drafts(
    logp: torch.Tensor, drafts: list[list[int]], *, greedy: bool, rng: torch.Generator
) -> tuple[list[list[int]], list[list[float]]]:
    """Verify drafts against the model's log-probs: the tokens each row emits, and theirs.

    Position ``j`` of row ``i`` holds the distribution after its ``j`` first draft tokens.
    Greedy: accept while the draft equals the argmax, then emit the argmax (the first
    disagreement, or a bonus token after a fully accepted draft). Sampling, for a deterministic
    draft: accept draft token ``d`` with probability ``p(d)``; at the first rejection sample from
    ``p`` with ``d`` removed and renormalised; all accepted: sample a bonus token from the last
    position. Either way each emitted token has the plain decoding's distribution.

    Args:
        logp: ``[batch, width, vocab]`` log-probs (tempered, forced rows' EOS masked).
        drafts: each row's draft, at most ``width - 1`` tokens.
        greedy: argmax instead of sampling.
        rng: the sampling generator (on ``logp``'s device).

    Returns:
        Per row, the emitted tokens (accepted drafts plus one) and their log-probs under
        ``logp``, the values plain decoding would report.
    """
    width = logp.shape[1]
    dev = logp.device
    padded = torch.tensor([d + [0] * (width - 1 - len(d)) for d in drafts], device=dev)
    if greedy:
        best = logp.argmax(dim=-1)  # [batch, width]
        agree = (padded == best[:, :-1]).tolist()
        stops = [_leading(agree[i], len(d)) for i, d in enumerate(drafts)]
        last = best.gather(1, torch.tensor(stops, device=dev)[:, None]).squeeze(1).tolist()
    else:
        probs = logp.exp()  # [batch, width, vocab]
        p_draft = probs[:, :-1].gather(2, padded[..., None]).squeeze(2)  # [batch, width - 1]
        coins = torch.rand(p_draft.shape, generator=rng, device=dev)
        agree = (coins < p_draft).tolist()
        stops = [_leading(agree[i], len(d)) for i, d in enumerate(drafts)]
        last = _resample(probs, padded, drafts, stops, rng)
    tokens = [[*d[:j], t] for d, j, t in zip(drafts, stops, last, strict=True)]
    emitted = torch.tensor([t + [0] * (width - len(t)) for t in tokens], device=dev)
    chosen = logp.gather(2, emitted[..., None]).squeeze(2).tolist()  # [batch, width]
    return tokens, [chosen[i][: len(t)] for i, t in enumerate(tokens)]


def _resample(
    probs: torch.Tensor,
    padded: torch.Tensor,
    drafts: list[list[int]],
    stops: list[int],
    rng: torch.Generator,
) -> list[int]:
    """Each row's token after its accepted drafts: from ``p`` at the stop position, with the
    rejected draft token removed where one was rejected."""
    dev = probs.device
    rows = torch.arange(len(drafts), device=dev)
    at = torch.tensor(stops, device=dev)
    plain = probs[rows, at]  # [batch, vocab]
    residual = plain.clone()
    rejected = torch.tensor([j < len(d) for d, j in zip(drafts, stops, strict=True)], device=dev)
    if rejected.any():
        hit = rows[rejected]
        residual[hit, padded[hit, at[hit]]] = 0.0
    # A rejected token whose probability rounds to 1 leaves nothing to renormalise (a
    # floating-point event of measure zero): sample from p itself there.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, plain)
    return torch.multinomial(residual, 1, generator=rng).squeeze(1).tolist()


def _leading(agree: list[bool], n: int) -> int:
    """How many of the first ``n`` entries are true before the first false one."""
    for j in range(n):
        if not agree[j]:
            return j
    return n
