"""Noise floors: the reference read again under changes that should not matter, the floor under which a method's KL
or answer change is no evidence of anything. One-token steps in a batch of other prompts (`stepped`, `noise_floor`,
`stepped_noise`), and another compute dtype (`dtype_floor`)."""

from __future__ import annotations

import torch
from torch.profiler import record_function
from transformers import DynamicCache

from kvlab.engine.greedy import Group, greedy, join_groups
from kvlab.engine.teacher import first_divergence
from kvlab.models.structure import is_sliding


@torch.no_grad()
@record_function("kvlab.stepped")
def stepped(model, requests: list[tuple[DynamicCache, list[int], list[int], int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Dense caches of several prompts, each `(cache, tail, path, start)`, teacher-forced along their `path` one
    token at a time, as decoding feeds it: each tail as one chunk, then one step per path token, every prompt in one
    right-padded batch at its own positions (as `decode_references` decodes), a row leaving once its path ends.
    Models with sliding-window layers step each prompt alone. Per request: log-probabilities (len(path), V) and
    the greedy choice at each position (len(path),)."""
    if len(requests) > 1 and any(is_sliding(model, i) for i in range(len(requests[0][0].layers))):
        return [out for request in requests for out in stepped(model, [request])]
    if any(not tail or not path for _, tail, path, _ in requests):
        raise ValueError("stepping a path needs a tail token after the cache and at least one path token")
    batch, first = join_groups(model, [Group([cache], tail, start, len(path)) for cache, tail, path, start in requests])
    paths = [path for _, _, path, _ in requests]
    logits = [[f] for f in first]
    live = list(range(len(requests)))
    for step in range(max(map(len, paths)) - 1):
        going = [row for row, i in enumerate(live) if len(paths[i]) > step + 1]
        if not going:
            break
        if len(going) < len(live):
            batch.keep(going)
            live = [live[r] for r in going]
        out = batch.forward(torch.tensor([[paths[i][step]] for i in live], device=model.device), step)[:, -1]
        for row, i in enumerate(live):
            logits[i].append(out[row])
    results = []
    for rows in logits:
        stacked = torch.stack(rows)
        results.append((torch.log_softmax(stacked.float(), dim=-1), greedy(stacked)))
    return results


@torch.no_grad()
@record_function("kvlab.noise_floor")
def noise_floor(model, requests: list[tuple[DynamicCache, list[int], list[int], int, torch.Tensor]]) -> list[dict]:
    """The reference against itself under changes that should not matter. Each request `(cache, tail, path, start,
    logp_ref)` is a full row whose `logp_ref` (len(path), V) came from the one pass it shared with every other row of
    its prompt; here its cache is teacher-forced again one token at a time, in a batch of the other requests'
    prompts, right-padded (`stepped`). Per request: mean and max per-token KL(one pass ‖ steps) in nats, and where
    the steps' greedy choice first leaves `path` (None: nowhere). What rounding alone does: a KL or an answer change
    of a method no larger than this is no evidence of anything. (On a CPU in fp32, the same pass alone or in a batch,
    padded or not, gave bitwise equal logits on the tiny model; one-token steps take other kernels.)"""
    return [_against("noise", logp_ref, logp, choice, path)
            for (_, _, path, _, logp_ref), (logp, choice) in zip(requests, stepped(model, [r[:4] for r in requests]))]


def stepped_noise(logp_ref: torch.Tensor, logits: torch.Tensor, one_pass_first: int | None) -> dict:
    """`noise_floor`'s columns for a full row whose one-token steps along its path were already taken: `logits`
    (len(path), V), those the reference's own decoding chose the path from (`decode_references`' `keep`), in a batch
    of other prompts, right-padded, as `noise_floor` would step it again. Their greedy choice is the path itself, so
    where the two readings' answers part is where the one pass's choice first leaves the path (`one_pass_first`, the
    full row's `first_divergence`; None: nowhere): `noise_diverged_at`."""
    return {**_kl_columns("noise", logp_ref, torch.log_softmax(logits.float(), dim=-1)), "noise_diverged_at": one_pass_first}


def _against(prefix: str, logp_ref: torch.Tensor, logp: torch.Tensor, choice: torch.Tensor, path: list[int]) -> dict:
    """A noise floor's columns for one path: `_kl_columns`, and where the other reading's greedy `choice` first leaves
    `path` (None: nowhere), named `{prefix}_diverged_at`."""
    return {**_kl_columns(prefix, logp_ref, logp), f"{prefix}_diverged_at": first_divergence(choice[None], path)[0]}


def _kl_columns(prefix: str, logp_ref: torch.Tensor, logp: torch.Tensor) -> dict:
    """Mean and max per-token KL(reference ‖ other reading) in nats, named `{prefix}_kl`, `{prefix}_kl_max`."""
    kl = (logp_ref.exp() * (logp_ref - logp)).sum(-1).clamp_min(0)
    return {f"{prefix}_kl": float(kl.mean()), f"{prefix}_kl_max": float(kl.max())}


@torch.no_grad()
@record_function("kvlab.dtype_floor")
def dtype_floor(other, requests: list[tuple[list[int], list[int], torch.Tensor]]) -> list[dict]:
    """The reference in another compute dtype. `other` is the model loaded in that dtype (float32 beside a bfloat16
    run); each request `(ids, path, logp_ref)` is a full row: every token id fed before its path (prompt and turn),
    the path, and the log-probabilities (len(path), V) the run's full cache gave it. `other` reads `ids` and the path
    in one plain forward pass (its own dense cache, the model's own attention); requests with the same tokens (the
    agnostic and aware first turn) share it. Per request: mean and max per-token KL(run ‖ other dtype) in nats,
    and where the other dtype's greedy choice first leaves `path` (None: nowhere)."""
    out, done = [], {}
    for ids, path, logp_ref in requests:
        key = (tuple(ids), tuple(path))
        if key not in done:
            x = torch.tensor([list(ids) + list(path[:-1])], device=other.device)
            logits = other(input_ids=x, logits_to_keep=len(path), use_cache=False).logits[0]  # the last id predicts path[0]
            done[key] = (torch.log_softmax(logits.float(), dim=-1).to(logp_ref.device), greedy(logits).to(logp_ref.device))
        out.append(_against("dtype_noise", logp_ref, *done[key], path))
    return out

