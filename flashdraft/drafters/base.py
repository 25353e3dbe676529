"""The drafter protocol: what proposes tokens for the target to verify.

A drafter is told when a request begins, proposes up to k tokens from the committed context,
and is told how many of them the target accepted. Drafters are made in one place,
`make_drafter`, which is the only code that knows their names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..config import SamplingParams


@dataclass
class Draft:
    tokens: torch.Tensor  # [batch, k] int64, on the target's device; k may be 0
    q: torch.Tensor | None = None  # [batch, k, vocab] draft probabilities; None: one-hot


@dataclass
class DraftContext:
    tokens: list[int]  # the committed sequence: prompt + generated (the last is not yet in
                       # the target's cache)
    params: SamplingParams
    generator: torch.Generator | None
    # Outputs of the target's layers named by the drafter's `hidden_layers`, for the positions
    # of the last verification pass: each [batch, seq, hidden]. Empty when none were requested.
    hidden: list[torch.Tensor] = field(default_factory=list)


class Drafter(Protocol):
    hidden_layers: tuple[int, ...]  # target layers whose outputs the drafter needs; () for none

    def begin(self, prompt: list[int]) -> None: ...

    def propose(self, ctx: DraftContext, k: int) -> Draft: ...

    def commit(self, num_accepted: int) -> None: ...
