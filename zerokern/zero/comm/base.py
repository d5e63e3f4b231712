"""The collectives FusedZeroAdam uses, behind one small object.

World size 1 (no process group) makes every collective a no-op, so the same
optimizer code runs in one process. Averages are taken as SUM followed by a
division of the (small) result, because gloo has no AVG. Every collective is
labelled for the profiler (record_function "zerokern::<name>").

[Note: streams] On GPUs the collectives are issued with async_op=True: NCCL
runs them on its own internal stream, ordered after the work already queued
on the current stream (so a bucket's grads are complete), and Work.wait()
makes the current stream wait for them without blocking the host. That NCCL
stream is the "side stream" that overlaps reductions with the rest of
backward. On CPUs, gloo runs them on its own threads and wait() blocks.
With the collective check on ([Note: announced collectives]), the launch happens later, on the
check's thread: it makes a side stream wait for an event recorded on the caller's stream when
the collective was queued, and launches from that side stream, so the ordering is the same.
"""

import os
import time

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .works import DONE, Then


# torch 2.14 renamed the flat-tensor collectives; 2.11 has only the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _check_launched_alone():
    """No process group: one process. A launcher that started several (torchrun's WORLD_SIZE)
    means the group is not made yet, and going on would train each rank on its own, silently
    unsharded (HF: the model sharded before TrainingArguments, which makes the group)."""
    world = os.environ.get("WORLD_SIZE", "1")
    if world.strip().isdigit() and int(world) > 1:
        rank = os.environ.get("RANK", "?")
        raise RuntimeError(
            f"zerokern (rank {rank}): WORLD_SIZE={world} but torch.distributed has no process group yet, so "
            "each rank would train unsharded on its own. Call torch.distributed.init_process_group() first (HF "
            "Trainer: build TrainingArguments, which makes the group, before zerokern.shard and the optimizer)")


class Comm:
    """torch.distributed's collectives over one group, labelled, async, with agreement helpers.
    comm/factory.make_comm() picks the subclass for the group's backend (gloo.GlooComm) and hands it
    the group's collective check (check.py)."""

    # [Note: the collective for the backend] (comm/gloo.py): what a backend does fastest
    exchange_reduce = False  # a 2-rank reduce-scatter as an exchange of halves
    prefers_all_reduce = False  # a scratch bucket all-reduced (then this rank's range read)
    broadcast_gather = False  # an all-gather of own slices as one broadcast per rank

    def __init__(self, process_group=None, check=None):
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        if process_group is None:
            _check_launched_alone()
        self.group = process_group
        self.world_size = dist.get_world_size(process_group) if process_group is not None else 1
        self.rank = dist.get_rank(process_group) if process_group is not None else 0
        self.distributed = self.world_size > 1  # more than one rank: collectives run (fixed with the group)
        self.wait_seconds = 0.0  # host time spent waiting on collectives (bench/overlap.py reads it)
        self.check = check  # [Note: announced collectives] (check.py); None: launched directly

    @property
    def dp_size(self) -> int:
        """How many ranks' grads a reduced grad averages (hybrid_comm.HybridComm: the whole mesh's)."""
        return self.world_size

    @property
    def wire_rank(self) -> int:
        """What keys this rank's rounding of quantized grads ([Note: quantized reductions]): ranks
        that quantize in one collective must differ, or their errors would not average out."""
        return self.rank

    @property
    def leads(self) -> bool:
        """The one rank that gets what is handed to one rank (a full state dict)."""
        return self.rank == 0

    @property
    def shards(self) -> "Comm":
        """The group the state is sharded over: this one (hybrid sharding: the mesh's shard group)."""
        return self

    def _launch(self, name, tensor, start, blocks=False):
        """Every collective enters here once: start(group) launches it (async) on `group` and
        returns its Work. With the check on, it is announced to the other ranks first and
        launched, in order, by the check's thread on zerokern's own group ([Note: announced
        collectives]); the Work returned waits for both. Labelled for the profiler."""
        if not dist.is_initialized():
            # Without this check a step after destroy_process_group() still runs its
            # collectives on the shut-down group (torch keeps the object alive).
            raise RuntimeError(f"zerokern: {name} on rank {self.rank}: torch.distributed's process groups were "
                               "destroyed (dist.destroy_process_group()), but this optimizer still shards over "
                               "one; build a new optimizer after init_process_group()")
        if self.check is not None:
            data = self.check.data
            return self.check.submit(name, tensor, lambda: start(data), blocks=blocks)
        with record_function(f"zerokern::{name}"):
            return start(self.group)

    def reduce_scatter(self, output, input, name="reduce_scatter", wire=None):
        """Async SUM reduce-scatter of `input` (world_size * output.numel()) into `output`. wire: a
        bucket's GradWire (comm/wire.py) when its grads travel in another precision."""
        if not self.distributed:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return DONE
        if wire is not None:
            return self._wired_reduce_scatter(output, input, name, wire)
        return self._launch(name, input, lambda g: _reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=g,
                                                                    async_op=True))

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, name="all_reduce", across=None, wire=None):
        """across: the part of `tensor` still needed after (grads: this rank's range); hybrid
        sharding reads it ([Note: hybrid sharding]), and a quantized reduction that needs only
        this rank's range reduce-scatters into it. wire: as reduce_scatter's."""
        if not self.distributed:
            return DONE
        if wire is not None:
            return self._wired_all_reduce(tensor, name, across, wire)
        return self._launch(name, tensor, lambda g: dist.all_reduce(tensor, op=op, group=g, async_op=True))

    def _wired_reduce_scatter(self, output, input, name, w):
        """[Note: quantized reductions] (comm/wire.py); a cast for fp32/bf16. The GradWire handed
        in brings its own collectives, so no Comm imports comm/wire.py."""
        if w.bits is None:
            return self._cast(lambda o, i: self.reduce_scatter(o, i, name), output, input, w.dtype)
        return self._launch(name, input, lambda g: w.reduce_scatter(output, input, g, self.rank, self.world_size))

    def _wired_all_reduce(self, tensor, name, across, w):
        if w.bits is None:
            return self._cast(lambda o, i: self.all_reduce(i, name=name), tensor, tensor, w.dtype)
        if across is not None and across is not tensor and self._is_my_range(tensor, across):
            return self._wired_reduce_scatter(across, tensor, name, w)
        return self._launch(name, tensor, lambda g: w.all_reduce(tensor, g, self.rank, self.world_size),
                            blocks=self.world_size > 2)

    def _is_my_range(self, tensor, part) -> bool:
        """part is this rank's 1/world_size of tensor (a bucket's range)."""
        n = part.numel()
        return (tensor.numel() == n * self.world_size and part.is_contiguous()
                and part.data_ptr() == tensor.data_ptr() + self.rank * n * tensor.element_size())

    @staticmethod
    def _cast(run, output, input, dtype):
        """run(output, input) in `dtype`: the reduction of a copy, written back when waited for."""
        if input.dtype == dtype and output.dtype == dtype:
            return run(output, input)
        i = input.to(dtype)
        o = i if output is input else torch.empty(output.shape, dtype=dtype, device=output.device)
        return Then(run(o, i), lambda: output.copy_(o))

    def all_gather(self, output, input, name="all_gather", wire=None):
        """Async all-gather of every rank's `input` into `output` (input may be output's own slice).
        wire: a bucket's ParamWire (comm/wire.py) when the gather travels quantized: `input` is then
        what this rank sends (fp32), which the wire encodes and gathers through this Comm ([Note:
        one codec])."""
        if wire is not None:
            return wire.all_gather(self, output, input, name)
        if not self.distributed:
            return DONE
        return self._launch(name, output, lambda g: _all_gather(output, input, group=g, async_op=True))

    def _global_rank(self, group_rank):
        return dist.get_global_rank(self.group, group_rank) if self.group is not dist.group.WORLD else group_rank

    def broadcast(self, tensor, src_rank=0, name="broadcast"):
        """Async broadcast of `tensor` from group rank `src_rank`."""
        if not self.distributed:
            return DONE
        src = self._global_rank(src_rank)
        return self._launch(name, tensor, lambda g: dist.broadcast(tensor, src=src, group=g, async_op=True))

    def wait(self, work):
        t0 = time.perf_counter()
        work.wait()
        self.wait_seconds += time.perf_counter() - t0

    def broadcast_from_first(self, tensors, name="broadcast_params"):
        """Every rank takes group rank 0's values of `tensors` (blocking; one broadcast each, all
        launched before the first wait). A non-contiguous tensor travels as a contiguous copy."""
        if not self.distributed:
            return
        pairs = [(t, t.data if t.is_contiguous() else t.data.contiguous()) for t in tensors]
        for w in [self.broadcast(c, name=name) for _, c in pairs]:
            self.wait(w)
        with torch.no_grad():
            for t, c in pairs:
                if c.data_ptr() != t.data_ptr():
                    t.data.copy_(c)

    def differing(self, mine, what):
        """Every rank's `mine` (small, picklable) where the ranks' differ, else None. One
        collective, on every rank, so every rank can raise alike. `what` names the call (e.g.
        "zerokern.shard(Block)"): a rank that reached another agreement (it skipped a call the
        others made) makes every rank raise, saying what each was doing, instead of comparing
        unlike things."""
        # announced under one name: a rank at another agreement gets the message below, which says more
        everyone = self.gather_objects((what, mine), name="agreement")
        doing = [w for w, _ in everyone]
        if any(w != doing[0] for w in doing):
            raise RuntimeError(
                "zerokern: the ranks are at different calls, so their collectives would not pair: "
                + "; ".join(f"rank {r} in {w}" for r, w in enumerate(doing))
                + ". Every rank must make the same zerokern.shard() calls (with the same mesh=, if any), in the same "
                "order, and then build the optimizer")
        values = [m for _, m in everyone]
        return values if any(other != values[0] for other in values) else None

    def gather_objects(self, obj, name="gather_objects"):
        """Every rank's `obj` (small, picklable), on every rank."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size

        def start(group):
            dist.all_gather_object(out, obj, group=group)
            return DONE
        self.wait(self._launch(name, None, start))
        return out
