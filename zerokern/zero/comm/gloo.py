"""GlooComm: the ways gloo moves the same bytes faster than its own collectives.

[Note: the collective for the backend] Per backend, the fastest way to move the same bytes (17M
floats, 2 gloo ranks, bench/train_step.py --collectives): gloo's reduce-scatter takes 97 ms and its
all-reduce 60 ms, so on more than 2 ranks a stage-2 bucket (whose input is scratch) is all-reduced
(prefers_all_reduce); on 2 ranks every reduce-scatter is an exchange of halves, 38 ms ([Note:
reduce-scatter as an exchange]; tests set exchange_reduce False to force torch's). gloo's
all-gathers of own slices become one broadcast per rank ([Note: gather as broadcasts]). NCCL keeps
reduce-scatter and all-gather (comm.Comm), which move the fewest bytes.

Those choices are for one host. A group of more than 2 ranks that spans hosts reduce-scatters and
gathers host by host instead ([Note: collectives across hosts]), so that the slow link carries no
more than DDP's all-reduce puts on it.
"""

from typing import Hashable, List, Sequence, Tuple

import torch
import torch.distributed as dist

from .base import Comm
from .context import PROCESS
from .worker import OrderedWorker
from .works import DONE, AllOf, Pending, Then


# [Note: collectives across hosts] A flat group over several hosts (each with a slow link to
# the others) loses with the one-host choices above: a stage-2 bucket all-reduced by gloo's ring
# crosses every host boundary twice with 3/4 of the bucket (2 hosts x 2 ranks), and each rank's
# broadcast of its param slice sends it to every rank on the other hosts: flat ZeRO-2 put 1.84x
# DDP's bytes on the link (bench/multihost.py, 2026-12-02). Such a group reduce-scatters and
# gathers host by host, from p2p messages (HostPlan lays them out, a thread per group runs them):
#   reduce-scatter: chunk c (owned by group rank c) is summed on each host by one rank, its
#     relay there (the owner itself on the owner's host): every rank sends its part of c to its
#     host's relay of c; each relay sends its host's sum to the owner, which adds the hosts'
#     sums. Each host sends the others one host sum per chunk they own, so (H - 1) x the buffer
#     crosses hosts in all (H hosts), against 2 (N - 1) / N x H for a ring all-reduce over N
#     ranks (DDP's): 1x against 3x on 2 hosts x 2 ranks. Each rank sends (N - 1) / N of the
#     buffer in all where the hosts have equal ranks, as in a ring.
#   all-gather: the same path backwards: the owner sends its chunk to its host's ranks and to
#     each other host's relay of it, which forwards it to its host's ranks. Copies: exact.
# Each element is summed once, by its owner, in a fixed order (the ranks of a host in rank
# order, then the hosts in the order of their first ranks) whatever order the messages arrive
# in, so a result does not depend on timing. That is not the order of gloo's all-reduce, so
# the sums differ from the one-host path in the last bits, within the same bound (one rounding
# per add either way; tests/zero/comm/test_across_hosts.py checks the order bit for bit and the error).
# Hosts of unequal size work too: relay(h, c) wraps the owner's index on its host (the sends
# are then spread less evenly). The second step of each collective waits for the first, so a
# thread per group runs them ([Note: the relay thread]). Which ranks share a host is agreed
# once, when the Comm is made (comm/factory.py, [Note: what a host is]). CPU tensors only
# (gloo's p2p); 2 ranks keep the exchange and the broadcasts, which move the fewest bytes.
# Memory: the input is only read; a reduce-scatter receives into buffers of its own, (L - 1) / L
# of the input with L ranks a host plus one chunk per other host, freed when it is done.


class HostPlan:
    """Which host each rank of a group is on, and who relays what ([Note: collectives across
    hosts]). Pure: no torch.distributed, so the schedules can be checked on their own."""

    def __init__(self, hosts: Sequence[Hashable]):
        order = list(dict.fromkeys(hosts))  # the hosts in the order of their first rank
        self.host_of: Tuple[int, ...] = tuple(order.index(h) for h in hosts)
        self.members: Tuple[Tuple[int, ...], ...] = tuple(
            tuple(r for r, h in enumerate(self.host_of) if h == i) for i in range(len(order)))
        self.local: Tuple[int, ...] = tuple(self.members[h].index(r) for r, h in enumerate(self.host_of))

    @property
    def spans(self) -> bool:
        return len(self.members) > 1

    def relay(self, host: int, chunk: int) -> int:
        """The rank of `host` that sums (or forwards) chunk `chunk` for that host: the owner
        (group rank `chunk`) on its own host, else the rank at the owner's index on its host."""
        m = self.members[host]
        return m[self.local[chunk] % len(m)]

    def reduce_scatter_messages(self) -> List[Tuple[int, int, int, int]]:
        """(step, src, dst, chunk) of every message: step 0 a rank's own part to its host's relay,
        step 1 a relay's host sum to the owner."""
        n = len(self.host_of)
        first = [(0, r, self.relay(self.host_of[r], c), c) for r in range(n) for c in range(n)]
        second = [(1, self.relay(h, c), c, c) for c in range(n) for h in range(len(self.members))
                  if h != self.host_of[c]]
        return [m for m in first if m[1] != m[2]] + second

    def all_gather_messages(self) -> List[Tuple[int, int, int, int]]:
        """(step, src, dst, chunk): step 0 the owner's chunk to its host's ranks and the other hosts'
        relays, step 1 a relay's copy to its host's ranks."""
        out = []
        for c in range(len(self.host_of)):
            own = self.host_of[c]
            out += [(0, c, m, c) for m in self.members[own] if m != c]
            for h in range(len(self.members)):
                if h != own:
                    r = self.relay(h, c)
                    out += [(0, c, r, c)] + [(1, r, m, c) for m in self.members[h] if m != r]
        return out


# [Note: the relay thread] A collective across hosts is two steps of p2p messages, the second
# sent only once the first arrived (a host sum, a forwarded chunk). So that it runs while the
# caller goes on (a bucket's reduction overlaps the rest of backward), one thread per process
# group runs them, in the order they were launched: every rank launches a group's collectives
# in one order ([Note: one collective order]), so the k-th on every rank waits only for the
# k-th on the others, and a thread per group (not per process) keeps a rank's groups from
# waiting on each other. The messages of one collective carry the tags of its chunks (base +
# chunk: a pair of ranks exchanges a chunk once per collective), so they pair with nothing
# else on the group. The thread keeps no tensor once a collective is done ([Note: exit drain]).


class _Relays:
    """(A view, for the tests: each group's relay as (its queue, its thread); the workers are the
    groups' contexts', comm/context.py.)"""

    def values(self):
        return [(g.relay.queue, g.relay.thread) for g in list(PROCESS.groups.values()) if g.relay is not None]

    def __bool__(self):
        return bool(self.values())


_RELAYS = _Relays()


def _relayed(group, run) -> Pending:
    """run() on the group's relay, after the collectives handed to it before."""
    ctx = PROCESS.of(group)
    if ctx.relay is None:
        ctx.relay = OrderedWorker("zerokern-relay")
    return ctx.relay.hand(Pending(job=lambda: (run(), DONE)[1]))


_stop_relays = PROCESS.stop_relays  # (at exit: context.shutdown; the tests call it too)


def _wait_all(works):
    """Each once: a second wait() on a gloo p2p Work waits for a message that never comes."""
    for w in works:
        w.wait()


class GlooComm(Comm):
    def __init__(self, process_group=None, check=None, hosts=None):
        super().__init__(process_group, check)
        self.place(hosts)

    def place(self, hosts=None) -> None:
        """Take `hosts` (one hashable per group rank, equal for ranks on one host; None: one host)
        and the collectives that fit it ([Note: the collective for the backend], [Note:
        collectives across hosts]; 2 ranks exchange and broadcast either way: each sends the
        other half the buffer, the fewest bytes there are)."""
        self.hosts = HostPlan([0] * self.world_size if hosts is None else list(hosts))
        if len(self.hosts.host_of) != self.world_size:
            raise ValueError(f"zerokern: hosts names {len(self.hosts.host_of)} ranks, the group has {self.world_size}")
        self.exchange_reduce = self.world_size == 2
        self.across_hosts = self.world_size > 2 and self.hosts.spans
        self.prefers_all_reduce = not self.exchange_reduce and not self.across_hosts
        self.broadcast_gather = True
        # each group rank's global rank, a broadcast's src ([Note: gather as broadcasts]): fixed with the group
        self.global_ranks = [self._global_rank(r) for r in range(self.world_size)] if self.group is not None else [0]

    def reduce_scatter(self, output, input, name="reduce_scatter", wire=None):
        if wire is not None:  # an all-to-all of quantized chunks, or a cast ([Note: quantized reductions])
            return super().reduce_scatter(output, input, name, wire)
        if self.exchange_reduce and output.is_contiguous():
            return self._launch(name, input, lambda g: self._exchange(output, input, g))
        if self._relays(output, input) and input.numel() == output.numel() * self.world_size:
            return self._launch(name, input, lambda g: self._relay_reduce_scatter(output, input, g))
        return super().reduce_scatter(output, input, name)

    def _relays(self, output, input) -> bool:
        """Across hosts, CPU tensors (gloo's p2p), contiguous: [Note: collectives across hosts]."""
        return (self.across_hosts and output.device.type == "cpu" and input.device.type == "cpu"
                and output.is_contiguous() and input.is_contiguous() and output.dtype == input.dtype
                and output.numel() > 0 and input.numel() > 0)

    def _p2p(self, group):
        """isend/irecv of chunk-tagged messages for one collective on `group` ([Note: the relay thread])."""
        span = (1 << 30) // self.world_size
        base = (next(PROCESS.of(group).tags) % span) * self.world_size

        def send(tensor, dst, chunk):
            return dist.isend(tensor, self.global_ranks[dst], group=group, tag=base + chunk)

        def recv(tensor, src, chunk):
            return dist.irecv(tensor, self.global_ranks[src], group=group, tag=base + chunk)
        return send, recv

    def _relay_reduce_scatter(self, output, input, group):
        """[Note: collectives across hosts]: this rank's part of chunk c to its host's relay of c;
        the host sums of the chunks it relays to their owners; its own chunk summed from the hosts'
        sums, in host order. Every receive is posted at once; only the host sums wait."""
        plan, me, n = self.hosts, self.rank, output.numel()
        host, world = plan.host_of[me], self.world_size
        send, recv = self._p2p(group)
        mine = [c for c in range(world) if plan.relay(host, c) == me]  # the chunks this rank sums for its host
        peers = [m for m in plan.members[host] if m != me]
        parts = {(c, m): input.new_empty(n) for c in mine for m in peers}
        sums = {h: input.new_empty(n) for h in range(len(plan.members)) if h != host}
        recvs = {key: recv(t, key[1], key[0]) for key, t in parts.items()}
        recvs.update({("host", h): recv(t, plan.relay(h, me), me) for h, t in sums.items()})
        sends = [send(input[c * n:(c + 1) * n], plan.relay(host, c), c) for c in range(world)
                 if plan.relay(host, c) != me]

        def run():
            for c in mine:
                total, writable = None, False
                for m in plan.members[host]:  # fixed order: the host's ranks in rank order
                    if m == me:
                        part = input[c * n:(c + 1) * n]
                    else:
                        recvs[(c, m)].wait()
                        part = parts[(c, m)]
                    if total is None:
                        total, writable = part, m != me
                    elif writable:
                        total.add_(part)
                    else:  # total is this rank's input (read only): into the part's buffer; a + b is b + a exactly
                        total, writable = torch.add(total, part, out=part), True
                if c == me:
                    sums[host] = total
                else:
                    sends.append(send(total, c, c))
            for h in range(len(plan.members)):  # fixed order: the hosts in order
                if h != host:
                    recvs[("host", h)].wait()
                if h == 0:
                    output.copy_(sums[h])
                else:
                    output.add_(sums[h])
            _wait_all(sends)
        return _relayed(group, run)

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
        own = input[self.rank * n:(self.rank + 1) * n]
        return Then(work, lambda: output.add_(own))

    def all_gather(self, output, input, name="all_gather", wire=None):
        if wire is not None:  # the bytes come back here ([Note: one codec]): gathered as below
            return wire.all_gather(self, output, input, name)
        if self._relays(output, input) and output.numel() == input.numel() * self.world_size:
            return self._launch(name, output, lambda g: self._relay_all_gather(output, input, g))
        if self._gathers_by_broadcast(output, input):
            n, srcs = input.numel(), self.global_ranks
            return self._launch(name, output, lambda g: AllOf([
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

    def _relay_all_gather(self, output, input, group):
        """[Note: collectives across hosts]: this rank's chunk to its host's ranks and to the other
        hosts' relays of it; the chunks it relays, once arrived, to its host's ranks."""
        plan, me, n = self.hosts, self.rank, input.numel()
        host = plan.host_of[me]
        send, recv = self._p2p(group)
        chunk = output.view(self.world_size, n)  # chunk[c]: group rank c's
        if input.data_ptr() != chunk[me].data_ptr():
            chunk[me].copy_(input)
        peers = [m for m in plan.members[host] if m != me]
        relayed = [c for c in range(self.world_size) if plan.host_of[c] != host and plan.relay(host, c) == me]
        recvs = {}
        for c in range(self.world_size):
            if c != me:  # from its owner where that is on this host or this rank relays it, else from the relay
                src = c if plan.host_of[c] == host or c in relayed else plan.relay(host, c)
                recvs[c] = recv(chunk[c], src, c)
        sends = [send(chunk[me], m, me) for m in peers]
        sends += [send(chunk[me], plan.relay(h, me), me) for h in range(len(plan.members)) if h != host]

        def run():
            for c in relayed:
                recvs.pop(c).wait()
                sends.extend(send(chunk[c], m, c) for m in peers)
            _wait_all(recvs.values())
            _wait_all(sends)
        return _relayed(group, run)
