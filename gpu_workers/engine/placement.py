"""A process's place in a tensor/pipeline-parallel worker group: its tensor-parallel
rank and group (`TP`), its pipeline stage and the layers that stage holds (`Stage`).
Global rank = stage * tensor_parallel + tensor-parallel rank.

A leaf of the engine: the model (gpu_workers/models) and the model runner build on these
types, and it imports nothing of theirs. How ranks start and exchange steps is
`parallel.py`; a non-zero rank's process is `rank.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from plurai.gpu_workers.engine.config import EngineConfig


@dataclass
class TP:
    """This process's place in its stage's tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: Any = None  # the stage's process group (None: the whole world)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dimension."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass
class Stage:
    """This process's pipeline stage: a contiguous range of the model's layers."""

    index: int = 0
    count: int = 1
    layers: tuple[int, int] = (0, 0)  # [first, end) of the layers held here

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def split_layers(
    num_layers: int, stages: int, custom: list[int] | None = None
) -> list[tuple[int, int]]:
    """Layer ranges per stage: even (earlier stages take the remainder), or `custom` counts."""
    counts = custom or [num_layers // stages + (i < num_layers % stages) for i in range(stages)]
    if len(counts) != stages or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(
            f"pipeline split {counts} does not cover {num_layers} layers in {stages} stages"
        )
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def placement(config: EngineConfig, rank: int, num_layers: int) -> tuple[TP, Stage]:
    """Global rank -> (tensor-parallel place, pipeline stage). Rank = stage * tp + tp_rank."""
    tp, pp = config.tensor_parallel, config.pipeline_parallel
    stage = rank // tp
    group = None
    if dist.is_initialized() and pp > 1:
        # every process creates every stage's group, in the same order
        for s in range(pp):
            g = dist.new_group(list(range(s * tp, (s + 1) * tp)))
            if s == stage:
                group = g
    ranges = split_layers(num_layers, pp, config.pipeline_layers)
    return (
        TP(rank=rank % tp, size=tp, group=group),
        Stage(index=stage, count=pp, layers=ranges[stage]),
    )
