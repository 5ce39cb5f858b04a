"""The fast ranker's two models on one feature vector, and how they train (StreamRL §5.2).

- An MLP whose head gives each prompt's log-length location and spread (``length_head.py``).
- A linear model of the log length (ridge: squared error plus ``l2`` times its squared weights),
  trained next to it on its own loss. Many length rules are products (a count times the words
  per item, a passage times a language's ratio), sums in log space, which a linear model
  learns from few examples; the MLP learns the interactions (a word limit that caps a form).
  The ranker's location is the mean of the two: unlike models err unlike, and their mean errs
  less than either (on the requests set of ``streamrl bench ranker``, see docs/skewness.md).
"""

from __future__ import annotations

import torch

from streamrl.components.skewness.length_head import LogLengths, head_loss, widen_point_head

#: Adam learning rate of the linear model: it starts at the mean log length and has a long way
#: to go on features no MLP layer rescales.
LINEAR_LR = 1e-2


def make_mlp(width: int, hidden: int) -> torch.nn.Sequential:
    """Two GELU layers and the distributional head (location, raw spread)."""
    return torch.nn.Sequential(
        torch.nn.Linear(width, hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, 2),
    )


def load_mlp(weights: dict[str, torch.Tensor], width: int, hidden: int) -> torch.nn.Sequential:
    """``make_mlp`` with saved ``weights``; a one-output head (saved before issue 34) becomes
    the location, with the same spread for every prompt."""
    weights, head = dict(weights), "4"  # the head's index in make_mlp's Sequential
    if weights[f"{head}.weight"].shape[0] == 1:
        weights[f"{head}.weight"], weights[f"{head}.bias"] = widen_point_head(
            weights[f"{head}.weight"], weights[f"{head}.bias"]
        )
    mlp = make_mlp(width, hidden)
    mlp.load_state_dict(weights)
    return mlp


def make_linear(width: int, targets: LogLengths) -> torch.nn.Linear:
    """A linear model of the log length that starts at the samples' mean log length."""
    linear = torch.nn.Linear(width, 1)
    with torch.no_grad():
        linear.weight.zero_()
        linear.bias.fill_(float((targets.count * targets.mean).sum() / targets.count.sum()))
    return linear


def location(
    mlp_out: torch.Tensor, linear: torch.nn.Linear | None, x: torch.Tensor
) -> torch.Tensor:
    """The ranker's log-length location: the MLP's, averaged with the linear model's. ``[n]``"""
    if linear is None:  # a state saved before the linear model: the MLP alone
        return mlp_out[:, 0]
    return (mlp_out[:, 0] + linear(x).squeeze(-1)) / 2


def train_models(
    mlp: torch.nn.Module,
    linear: torch.nn.Linear,
    x: torch.Tensor,
    y: LogLengths,
    epochs: int,
    *,
    lr: float,
    rank_weight: float,
    l2: float,
    seed: int,
) -> None:
    """Full-batch Adam on both models, each on its own loss (they share no parameter).

    Args:
        mlp: the MLP (``make_mlp``), trained by ``head_loss`` on random pairs to rank.
        linear: the linear model (``make_linear``), trained by ridge.
        x: standardised features. ``[n, width]``
        y: the ``n`` prompts' log lengths.
        epochs: full-batch steps.
        lr: the MLP's learning rate.
        rank_weight: weight of the MLP's ranking term.
        l2: the ridge penalty, per squared weight, against the sum of squared errors.
        seed: seed of the random pairs.
    """
    optimizer = torch.optim.Adam(
        [
            {"params": mlp.parameters(), "lr": lr, "weight_decay": 1e-4},
            {"params": linear.parameters(), "lr": LINEAR_LR, "weight_decay": 0.0},
        ]
    )
    generator = torch.Generator().manual_seed(seed)
    weights = y.count / y.count.mean()  # [n]: a prompt weighs as many samples as it has
    for _ in range(epochs):
        # Pairwise ranking on random pairs: order matters more than the value (§5.2).
        i = torch.randint(len(y), (min(4096, len(y) * 4),), generator=generator)
        j = torch.randint(len(y), i.shape, generator=generator)
        loss = head_loss(mlp(x), y, rank_weight, (i, j))  # mlp(x): [n, 2]
        squared = weights * (linear(x).squeeze(-1) - y.mean) ** 2  # [n]
        loss = loss + squared.mean() + l2 * linear.weight.square().sum() / len(y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
