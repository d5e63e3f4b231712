"""The one place that says what a ZeRO stage means: ShardConfig (the options a user picks, the
stage among them) and Strategy, built from (stage, world size) by Strategy.of and read by every
other file as values (GradMode, ParamMode and two flags). No other file compares a stage number
(tests/zero/core/test_stage_definition.py checks that).

    stage  world  state     grads                 after step()       params
    0      any    whole     ALL_REDUCE (average)  kept               WHOLE
    1      > 1    sharded   SCATTER_KEEP (local)  kept               GATHER_AFTER_STEP
    2      > 1    sharded   SCATTER_RELEASE       freed              GATHER_AFTER_STEP
    3      > 1    sharded   SCATTER_RELEASE       freed              GATHER_PER_UNIT
    1-3    1      whole     ALL_REDUCE (no-op)    kept (1), freed    WHOLE
                                                  (2, 3)

On one process stages 2 and 3 train as stage 2: nothing to gather or scatter, but the full grad
buffers are freed after step() (the memory a user picked stage 2 or 3 for).
"""

import dataclasses
import enum
import os
from dataclasses import dataclass
from typing import Optional

import torch

from ...kernels import lowbit
from .precision import check_precisions
from .whole_matrices import WholeMatrices


class GradMode(enum.Enum):
    """What a bucket does with its gradients, and what .grad holds after backward."""

    ALL_REDUCE = "all_reduce"  # in place: .grad holds the average, as DDP (stage 0, or one process)
    SCATTER_KEEP = "scatter_keep"  # reduce-scatter; .grad keeps this rank's local grad (stage 1)
    SCATTER_RELEASE = "scatter_release"  # reduce-scatter, full buffer freed once reduced (stages 2, 3)


class ParamMode(enum.Enum):
    """Where the params' values live between steps."""

    WHOLE = "whole"  # every rank holds every param and updates all of it (stage 0, one process)
    GATHER_AFTER_STEP = "gather_after_step"  # whole on every rank; step() all-gathers the updated shards
    GATHER_PER_UNIT = "gather_per_unit"  # this rank's slices only; gathered per unit in forward/backward


@dataclass(frozen=True)
class OffloadPolicy:
    """Where the optimizer state and fp32 master weights live instead of the params' device; the
    update runs on the CPU with zerokern's CPU kernel either way.

    device="cpu": in (pinned) CPU memory; the reduced grad shard is copied over, the updated param
    shard back. device="nvme": in a scratch file under `path`, one per rank holding that rank's
    shard only, streamed through `buffer_count` chunks of `chunk_mb` MB per state array
    ([Note: NVMe swap] in zero/state/swap.py). fp32 params stay their own masters in memory; only
    the moments (ZeroOptimizer: its inner optimizer's per-element state) and fp16/bf16 params' fp32
    masters go to disk, unless params=True: at stage 3 the param shards too, read just before each
    gather and written by the update ([Note: stage-3 params on disk] in zero/state/nvme_store.py). FusedZeroAdam's low-bit state
    (state_precision "int8" or "bf16", master_weights True or False) goes to disk as it is held in
    memory: int8 codes and their block scales, or bf16 moments, and the fp32 masters if any (bf16
    params without masters stay in memory), in chunks of a multiple of 262,144 elements
    ([Note: low-bit chunks on disk] in zero/state/lowbit_nvme_store.py); device="cpu" does not
    take low-bit state yet."""

    device: str = "cpu"
    path: Optional[str] = None  # nvme: a directory on a local disk (not tmpfs); each rank's file is its own
    pin_memory: bool = True
    chunk_mb: float = 16.0  # nvme: MB of one state array streamed at a time
    buffer_count: int = 4  # nvme: chunks in flight: read ahead, being updated, being written back
    io_threads: int = 4  # nvme: threads issuing the reads and writes (O_DIRECT, aligned)
    params: bool = False  # nvme at stage 3: this rank's param shards on disk too (DeepSpeed's offload_param)

    def __post_init__(self):
        if self.device not in ("cpu", "nvme"):
            raise ValueError(f"OffloadPolicy(device={self.device!r}): choose 'cpu' (pinned CPU memory) or 'nvme' "
                             "(files under path=)")
        if self.device == "nvme" and (not isinstance(self.path, (str, os.PathLike)) or not str(self.path)):
            raise ValueError("OffloadPolicy(device='nvme') needs path=: a directory on a local disk, where each rank "
                             "writes one scratch file of its own shard's state")
        if self.device == "cpu" and self.path is not None:
            raise ValueError(f"OffloadPolicy(device='cpu', path={self.path!r}): a path is for device='nvme'")
        if not isinstance(self.params, bool):
            raise TypeError(f"OffloadPolicy(params=...) must be True or False, got {self.params!r}")
        if self.params and self.device != "nvme":
            raise ValueError("OffloadPolicy(params=True) keeps stage 3's param shards in the files under path=: it "
                             "needs device='nvme'")
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"OffloadPolicy(pin_memory=...) must be True or False, got {self.pin_memory!r}")
        if isinstance(self.chunk_mb, bool) or not isinstance(self.chunk_mb, (int, float)) or not (
                4096 <= self.chunk_mb * 2**20 < 2**40):
            raise ValueError(f"OffloadPolicy(chunk_mb=...) must be a number of MB, at least 4096 / 2**20 (4 KB, one "
                             f"disk block), got {self.chunk_mb!r}")
        for name in ("buffer_count", "io_threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (2 if name == "buffer_count" else 1):
                raise ValueError(f"OffloadPolicy({name}=...) must be an int >= {2 if name == 'buffer_count' else 1} "
                                 f"(got {v!r})")

    @property
    def compute_device(self) -> torch.device:
        """Where the update runs and the in-memory state lives."""
        return torch.device("cpu")

    @property
    def on_disk(self) -> bool:
        return self.device == "nvme"


@dataclass(frozen=True)
class ShardConfig:
    """How a unit is sharded. stage: 0 (replicated, all-reduce, as DDP), 1
    (optimizer state sharded), 2 (gradients too: full buffers freed as they are reduced), 3
    (params too: gathered for the unit's forward and backward only, [Note: stage-3 params] in
    params/per_unit.py). reshard_after_forward (stage 3): free the unit's full params after its forward
    and gather them again for its backward (False keeps them until backward, trading memory
    for one gather, as FSDP2's option of the same name)."""

    stage: int = 2
    bucket_cap_mb: float = 25.0
    overlap_comm: bool = True
    offload: Optional[OffloadPolicy] = None
    align: int = 16
    overlap_param_gather: bool = False  # [Note: gather behind forward] in params/gather.py
    reshard_after_forward: bool = True  # stage 3 only
    # [Note: quantized reductions] in comm/wire.py: what grads and gathered params travel in (None: as they are)
    reduce_precision: Optional[str] = None
    gather_precision: Optional[str] = None
    # the params a matrix optimizer steps whole (ZeroOptimizer with torch.optim.Muon): laid out so
    # each lies whole in one rank's shard (flat_plan.py); None: plan_layout's flat buckets
    matrices: Optional[WholeMatrices] = None

    def __post_init__(self):
        if isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0, 1, 2 or 3, got {self.stage!r}")
        if self.matrices is not None and not isinstance(self.matrices, WholeMatrices):
            raise TypeError(f"matrices must be None or a WholeMatrices, got {type(self.matrices).__name__}")
        check_precisions(self.reduce_precision, self.gather_precision)
        if self.stage == 0 and self.gather_precision is not None:
            raise ValueError(f"zerokern: gather_precision={self.gather_precision!r} at stage 0, where nothing is "
                             "gathered: every rank updates its own full params. Use stage 1, 2 or 3 for quantized "
                             "param gathers, or leave gather_precision=None")
        if not isinstance(self.reshard_after_forward, bool):
            raise TypeError(f"reshard_after_forward must be True or False, got {self.reshard_after_forward!r}")
        if self.stage == 3 and self.overlap_param_gather:
            raise ValueError("overlap_param_gather is for stages 1 and 2: at stage 3 every unit's params are "
                             "gathered in its forward (the next unit's gather prefetched); leave it off")
        if self.stage == 3 and self.offload is not None and not self.offload.on_disk:
            raise ValueError("offload at stage 3 is not offered yet; use stage=2 with offload, or stage=3 without")
        if self.stage != 3 and self.offload is not None and self.offload.params:
            raise ValueError(f"OffloadPolicy(params=True) puts stage 3's param shards on disk, but at stage {self.stage} "
                             "every rank holds the whole params in memory: use stage 3, or params=False")
        if isinstance(self.bucket_cap_mb, bool) or not isinstance(self.bucket_cap_mb, (int, float)):
            raise TypeError(f"bucket_cap_mb must be a number, got {type(self.bucket_cap_mb).__name__}")
        if not 0 < self.bucket_cap_mb < float("inf"):
            raise ValueError(f"bucket_cap_mb must be > 0 and finite, got {self.bucket_cap_mb}")
        if not isinstance(self.overlap_comm, bool):
            raise TypeError(f"overlap_comm must be True or False, got {self.overlap_comm!r}")
        if not isinstance(self.overlap_param_gather, bool):
            raise TypeError(f"overlap_param_gather must be True or False, got {self.overlap_param_gather!r}")
        if self.offload is not None and not isinstance(self.offload, OffloadPolicy):
            raise TypeError(f"offload must be None or a zerokern.OffloadPolicy, got {type(self.offload).__name__}")

    def strategy(self, world_size: int) -> "Strategy":
        return Strategy.of(self.stage, world_size)

    def agreed(self) -> "ShardConfig":
        """What every rank must pass alike: all of it but an NVMe path, which may be each rank's
        own disk (the ranks' disks add up), and the matrices' process-local ids (whole_matrices.py)."""
        out = self
        if self.offload is not None and self.offload.path is not None:
            out = dataclasses.replace(out, offload=dataclasses.replace(self.offload, path="<each rank's own>"))
        if self.matrices is not None:
            out = dataclasses.replace(out, matrices=self.matrices.agreed())
        return out


@dataclass(frozen=True)
class Strategy:
    """A ZeRO stage on a world size, as the values the runtime acts on. Build with Strategy.of."""

    stage: int  # for messages and repr only
    world_size: int
    shards_state: bool  # fp32 masters and optimizer state sharded over the ranks
    grads: GradMode
    frees_grads_after_step: bool  # the full grad buffers go after step() (stages 2 and 3, any world)
    params: ParamMode
    needs_units: bool  # every trainable param must be in a zerokern.shard() unit (stage 3)
    materializes_meta: bool  # zerokern.shard() may take a meta-device module (stage 3)

    @staticmethod
    def of(stage: int, world_size: int) -> "Strategy":
        if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
        several = world_size > 1
        if not several or stage == 0:
            grads = GradMode.ALL_REDUCE
        else:
            grads = GradMode.SCATTER_KEEP if stage == 1 else GradMode.SCATTER_RELEASE
        if not several or stage == 0:
            params = ParamMode.WHOLE
        else:
            params = ParamMode.GATHER_PER_UNIT if stage == 3 else ParamMode.GATHER_AFTER_STEP
        return Strategy(stage, world_size, several and stage >= 1, grads, stage >= 2, params,
                        needs_units=stage == 3, materializes_meta=stage == 3)

    @property
    def reduce_scatters(self) -> bool:
        return self.grads is not GradMode.ALL_REDUCE

    @property
    def local_grads(self) -> bool:
        """.grad holds this rank's local (unreduced) grad after backward, not the average."""
        return self.grads is not GradMode.ALL_REDUCE

    @property
    def layout_world(self) -> int:
        """How many ranks the bucket layout splits into (1: every rank holds whole buckets)."""
        return self.world_size if self.shards_state else 1


PRECISIONS = ("fp32", "bf16", "int8")
_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}


@dataclass(frozen=True)
class StatePolicy:
    """How an optimizer keeps its state. precision: Adam's moments in fp32, bf16 (stochastically
    rounded) or int8 blocks; master_weights False: bf16 params updated in place, stochastically
    rounded, with no fp32 copy. seed keys the rounding ([Note: reproducible rounding])."""

    precision: str = "fp32"
    master_weights: bool = True
    seed: int = 0

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"state_precision must be one of {', '.join(map(repr, PRECISIONS))}, "
                             f"got {self.precision!r}")
        if not isinstance(self.master_weights, bool):
            raise TypeError(f"master_weights must be True or False, got {self.master_weights!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"rounding_seed must be an int in [0, 2**63), got {self.seed!r}")

    @property
    def plain(self) -> bool:
        """fp32 moments with masters: ShardStore's own format."""
        return self.precision == "fp32" and self.master_weights

    @property
    def align(self) -> Optional[int]:
        return lowbit.BLOCK if self.precision == "int8" else None

    @property
    def state_dtype(self) -> torch.dtype:
        return _DTYPE[self.precision]


def optimizer_stage(zero_stage, world_size: int) -> int:
    """FusedZeroAdam(zero_stage=...) for params it buckets itself (no zerokern.shard()): None picks
    2 on several ranks, else 0; stage 3 needs units."""
    if zero_stage == 3:
        raise ValueError("zero_stage=3 shards the params too, so they are gathered in the forward hooks of the "
                         "modules that own them: shard the model with zerokern.shard(block, stage=3) for each "
                         "block, then zerokern.shard(model, stage=3), and build FusedZeroAdam(model.parameters())")
    if isinstance(zero_stage, bool) or zero_stage not in (None, 0, 1, 2):
        raise ValueError(f"zero_stage must be None, 0, 1 or 2, got {zero_stage!r}")
    return zero_stage if zero_stage is not None else (2 if world_size > 1 else 0)
