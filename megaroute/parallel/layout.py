"""The parallel layout: one validated object that owns the TP x DP decomposition of the world.

    rank = dp_rank * tp + tp_rank
    TP groups: consecutive ranks  [0, 1], [2, 3], ...   (tensor parallelism stays inside a node)
    DP groups: strided ranks      [0, 2], [1, 3], ...   (ZeRO reduces/partitions over these only)
    EP groups (ep > 1, MoE): ep consecutive DP ranks of one TP lane: ep_rank = dp_rank % ep
    expert-DP groups: the DP ranks of one lane with the same ep_rank (dp / ep of them), over which
        the expert gradients are averaged (DeepSpeed's E + D convention; the groups themselves are
        created by DeepSpeed's groups API in train/engine.py and handed back with set_expert_groups)

Everything that can be wrong (sizes vs. the world, model dims vs. tp) is checked when the layout
is built, before any process group exists. `init_process_groups()` then creates the groups (a
collective: every rank calls it, in the same order). The object is also DeepSpeed's `mpu`:
the get_* methods below are the interface DeepSpeed 0.19 queries. Pipeline parallelism is not
used (size 1); sequence-parallel hooks are deliberately absent, since their mere presence
switches DeepSpeed into Ulysses mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

from ..config import ConfigError, ModelConfig, ParallelConfig


@dataclass
class ParallelLayout:
    tp: int
    dp: int
    rank: int = 0
    ep: int = 1
    _tp_group: Optional[dist.ProcessGroup] = field(default=None, init=False, repr=False)
    _dp_group: Optional[dist.ProcessGroup] = field(default=None, init=False, repr=False)
    _groups_ready: bool = field(default=False, init=False, repr=False)
    _ep_group: Optional[dist.ProcessGroup] = field(default=None, init=False, repr=False)
    _edp_group: Optional[dist.ProcessGroup] = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.tp < 1:
            raise ConfigError("parallel.tp", f"must be >= 1, got {self.tp}")
        if self.dp < 1:
            raise ConfigError("parallel.dp", f"must be >= 1, got {self.dp}")
        if self.ep < 1 or self.dp % self.ep:
            raise ConfigError("parallel.ep", f"ep={self.ep} must be >= 1 and divide the data-parallel size "
                                             f"dp={self.dp} (expert-parallel ranks are carved from the DP ranks)")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside the world of {self.world_size} = tp {self.tp} x dp {self.dp}")

    @classmethod
    def from_config(cls, parallel: ParallelConfig, world_size: int, rank: int = 0,
                    model: Optional[ModelConfig] = None) -> "ParallelLayout":
        """Validates parallel.tp / parallel.dp against the world size (and the model's split
        dimensions when given); dp = 0 derives world_size // tp. Creates no process group."""
        tp = parallel.tp
        if tp < 1:
            raise ConfigError("parallel.tp", f"must be >= 1, got {tp}")
        if world_size % tp:
            raise ConfigError("parallel.tp", f"tp={tp} does not divide the world size {world_size}")
        dp = parallel.dp or world_size // tp
        if tp * dp != world_size:
            raise ConfigError("parallel.dp", f"tp x dp = {tp} x {dp} = {tp * dp} does not match the world size "
                                             f"{world_size}")
        if model is not None:
            parallel.check_model(model)
        return cls(tp=tp, dp=dp, rank=rank, ep=parallel.ep)

    # ---- pure arithmetic (no process group needed) ----
    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    def tp_group_ranks(self, dp_rank: Optional[int] = None) -> list[int]:
        d = self.dp_rank if dp_rank is None else dp_rank
        return list(range(d * self.tp, (d + 1) * self.tp))

    def dp_group_ranks(self, tp_rank: Optional[int] = None) -> list[int]:
        t = self.tp_rank if tp_rank is None else tp_rank
        return list(range(t, self.world_size, self.tp))

    @property
    def ep_rank(self) -> int:
        """Which slice of the experts this rank holds: experts [ep_rank * E/ep, (ep_rank + 1) * E/ep)."""
        return self.dp_rank % self.ep

    @property
    def expert_dp_rank(self) -> int:
        return self.dp_rank // self.ep

    def ep_group_ranks(self) -> list[int]:
        first = self.expert_dp_rank * self.ep
        return [(first + e) * self.tp + self.tp_rank for e in range(self.ep)]

    def expert_dp_group_ranks(self) -> list[int]:
        return [(d * self.ep + self.ep_rank) * self.tp + self.tp_rank for d in range(self.dp // self.ep)]

    def set_expert_groups(self, ep_group: dist.ProcessGroup, edp_group: dist.ProcessGroup,
                          ep_ranks: list[int], edp_ranks: list[int]) -> None:
        """The groups DeepSpeed created (train/engine.py), checked against this layout's arithmetic."""
        if list(ep_ranks) != self.ep_group_ranks() or list(edp_ranks) != self.expert_dp_group_ranks():
            raise RuntimeError(f"rank {self.rank}: DeepSpeed's expert groups {list(ep_ranks)} / {list(edp_ranks)} differ "
                               f"from the layout's {self.ep_group_ranks()} / {self.expert_dp_group_ranks()}")
        self._ep_group, self._edp_group = ep_group, edp_group

    @property
    def ep_group(self) -> Optional[dist.ProcessGroup]:
        """The expert-parallel group (None at ep = 1: every rank holds every expert)."""
        if self.ep == 1:
            return None
        if self._ep_group is None:
            raise RuntimeError("expert groups not created: train.engine.init_expert_groups(layout) first")
        return self._ep_group

    # ---- process groups ----
    def init_process_groups(self) -> "ParallelLayout":
        """Creates every TP and DP group (collective; the default group must exist and match)."""
        if not dist.is_initialized():
            raise RuntimeError("init_process_groups() needs torch.distributed to be initialized")
        if dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
            raise RuntimeError(f"layout {self} does not match the process group (rank {dist.get_rank()} of "
                               f"{dist.get_world_size()})")
        if self.tp == 1:
            # No TP: the layers get group None and DP is the whole world; world-size many
            # singleton groups would only cost start-up time on a large cluster.
            self._dp_group, self._groups_ready = dist.group.WORLD, True
            return self
        # new_group is collective over the whole world: all ranks create all groups, in one order.
        for d in range(self.dp):
            group = dist.new_group(self.tp_group_ranks(d))
            if d == self.dp_rank:
                self._tp_group = group
        for t in range(self.tp):
            group = dist.new_group(self.dp_group_ranks(t))
            if t == self.tp_rank:
                self._dp_group = group
        self._groups_ready = True
        return self

    def _require_groups(self) -> None:
        if not self._groups_ready:
            raise RuntimeError("process groups not created: call layout.init_process_groups() first")

    @property
    def tp_group(self) -> Optional[dist.ProcessGroup]:
        """The group to pass to model layers: None at tp = 1, so they run as plain layers."""
        if self.tp == 1:
            return None
        self._require_groups()
        return self._tp_group

    # ---- DeepSpeed mpu interface (passed to DeepSpeed only when tp > 1) ----
    def get_tensor_model_parallel_group(self) -> Optional[dist.ProcessGroup]:
        self._require_groups()
        return self._tp_group

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's TP group."""
        return self.dp_rank * self.tp

    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        self._require_groups()
        return self._dp_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_group_ranks()

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0
