"""GlooComm: the ways gloo moves the same bytes faster than its own collectives.

[Note: the collective for the backend] Per backend, the fastest way to move the same bytes (17M
floats, 2 gloo ranks, bench/train_step.py --collectives): gloo's reduce-scatter takes 97 ms and its
all-reduce 60 ms, so on more than 2 ranks a stage-2 bucket (whose input is scratch) is all-reduced
(prefers_all_reduce); on 2 ranks every reduce-scatter is an exchange of halves, 38 ms ([Note:
reduce-scatter as an exchange]; tests set exchange_reduce False to force torch's). gloo's
all-gathers of own slices become one broadcast per rank ([Note: gather as broadcasts]). NCCL keeps
reduce-scatter and all-gather (comm.Comm), which move the fewest bytes.
"""

import time

import torch.distributed as dist

from .base import Comm, finished


class _AllOf:
    """Several collectives that together make one (the broadcasts of a gather)."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self.works)

    def wait_for(self, seconds) -> bool:
        return _all_finished(self.works, seconds)


def _all_finished(works, seconds) -> bool:
    """Waits up to `seconds` in all for `works`: True once every one completed."""
    deadline = time.monotonic() + seconds
    return all(finished(w, deadline - time.monotonic()) for w in works)


class _SumOnWait:
    """The exchange of a 2-rank reduce-scatter: when it is waited for, this rank's own part is
    added to the peer's part that arrived in `output`."""

    def __init__(self, works, output, own):
        self.works, self.output, self.own = works, output, own

    def wait(self):
        for w in self.works:
            w.wait()
        self.output.add_(self.own)
        self.works = []
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self.works)

    def wait_for(self, seconds) -> bool:
        return _all_finished(self.works, seconds)


class GlooComm(Comm):
    def __init__(self, process_group=None, check=None):
        super().__init__(process_group, check)
        self.exchange_reduce = self.world_size == 2
        self.prefers_all_reduce = not self.exchange_reduce
        self.broadcast_gather = True

    def reduce_scatter(self, output, input, name="reduce_scatter"):
        if self.exchange_reduce and output.is_contiguous():
            return self._launch(name, input, lambda g: self._exchange(output, input, g))
        return super().reduce_scatter(output, input, name)

    def _exchange(self, output, input, group):
        """[Note: reduce-scatter as an exchange] On 2 gloo ranks, reduce_scatter_tensor takes 97 ms
        for 17M floats and all_reduce 60 ms, but sending the peer its half and receiving ours
        (then one add) 38 ms (bench/train_step.py --collectives): each rank moves half the
        buffer once, the fewest bytes any reduce-scatter moves. The input is only read. The sum
        of two values does not depend on their order, so both ranks' results are what an
        all-reduce would give. The exchange is one all_to_all_single whose only non-empty parts go
        to and come from the peer (as fast as an isend/irecv pair here: 36.6 vs 36.9 ms for 17M
        floats), because a collective's wait can be bounded and a gloo send's cannot (a timed
        wait on it closes the connection), which planned collectives need ([Note: planned
        collectives] in check.py)."""
        n, peer = output.numel(), 1 - self.rank
        sizes = [0, 0]
        sizes[peer] = n
        work = dist.all_to_all_single(output, input[peer * n:(peer + 1) * n], output_split_sizes=sizes,
                                      input_split_sizes=sizes, group=group, async_op=True)
        return _SumOnWait([work], output, input[self.rank * n:(self.rank + 1) * n])

    def all_gather(self, output, input, name="all_gather"):
        if self._gathers_by_broadcast(output, input):
            n = input.numel()
            srcs = [self._global_rank(r) for r in range(self.world_size)]
            return self._launch(name, output, lambda g: _AllOf([
                dist.broadcast(output[r * n:(r + 1) * n], src=srcs[r], group=g, async_op=True)
                for r in range(self.world_size)]))
        return super().all_gather(output, input, name)

    def _gathers_by_broadcast(self, output, input):
        """[Note: gather as broadcasts] gloo's all_gather_into_tensor is about three times as slow
        as one broadcast per rank of its own slice (81 ms vs 27 ms for 17M floats on 2 ranks,
        bench/train_step.py --collectives), which moves the same bytes. Where `input` is this
        rank's own slice of `output` (the param buffers after the update), gloo gathers that way;
        a broadcast copies bytes, so the result is exact. NCCL keeps its all-gather."""
        n = input.numel()
        return (self.broadcast_gather and output.numel() == n * self.world_size and output.is_contiguous()
                and input.data_ptr() == output.data_ptr() + self.rank * n * output.element_size())
