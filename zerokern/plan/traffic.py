"""Bytes each step sends, by collective and precision, within and between hosts; and the memory of
the error feedback that quantized reductions keep. Pure arithmetic, no torch.

[Note: bytes on the wire] P params (this GPU's model-parallel share), b bytes per element of the
training dtype, dp data-parallel ranks on h hosts, s = dp / h ranks per host, consecutive ranks
on one host. An element of a reduction travels in e bytes,
    None: e = b;  "fp32": e = 4;  "bf16": e = 2  (a cast)
and a chunk of n elements quantized ([Note: the wire format] in zerokern/kernels/wire.py: blocks
of 64, an fp32 scale each) takes
    q(n) = 4 ceil(n / 64) + n          (int8)
    q(n) = 4 ceil(n / 64) + ceil(n / 2) (int4)
rounded up to a multiple of 4 bytes (each chunk's scales start aligned in the collective's buffer).
gather_precision="int8" sends each rank's shard of params as q(n) (int8) in the param
all-gathers; None sends b n. The collectives ([Note: quantized reductions] in zerokern/zero/comm/
wire.py), bytes one rank sends:
    ring reduce-scatter / all-gather of P over g ranks:  (g - 1)/g P e   (all-reduce: twice that)
    quantized reduce-scatter: an all-to-all, q(ceil(P/g)) to each of the other g - 1 ranks
    quantized all-reduce: g = 2, the whole q(P) to the other rank; g > 2, the all-to-all above,
        then an all-gather of its q(ceil(P/g)) chunk of the sum: 2 (g - 1) q(ceil(P/g))
Between hosts, all links together: a ring over ranks on h > 1 hosts crosses between hosts h
times (each crossing carries one rank's sends), so h of its g rank-sends cross; in an all-to-all
a rank sends to dp - s ranks on other hosts and s - 1 on its own.

Flat sharding (one group of dp ranks): stage 0 all-reduces the grads; stages 1-3 reduce-scatter
them; stages 1/2 all-gather the updated params after step, stage 3 gathers each unit's params for
forward and again for backward (2 all-gathers), in the params' dtype or int8 blocks.

Hybrid sharding (mesh=(h, s), [Note: hybrid sharding] in zerokern/zero/comm/hybrid.py): the
grads are reduced within a host in their dtype (stage 0 an all-reduce of P, stages 1-3 a
reduce-scatter), then all-reduced across the h hosts, over one rank per host, in reduce_precision:
at stage 0 each rank's whole bucket (P), from stage 1 on its reduced shard (P / s). Every rank
takes part in one replica all-reduce, so across = dp x that all-reduce's bytes (what
HybridComm.inter_host_bytes counts, summed over the ranks). The param gathers stay within a host
and in the params' dtype: gather_precision applies without a mesh only.
The scales are counted as if the params were one bucket: each further bucket whose chunk ends
in a part block adds under 4 bytes per chunk (and the layout's padding is not counted).

[Note: error feedback memory] A quantized reduction (int8, int4) keeps, per bucket, a bf16
residual of what the rank quantizes ([Note: error feedback] in comm/wire.py): flat, the whole
bucket (stages 0-3), plus on an all-reduce over more than 2 ranks (flat stage 0) its chunk of the
sum; hybrid, what crosses hosts (P at stage 0, the shard P / s from stage 1), plus its chunk of
that (/ h) when h > 2. Each is kept committed and pending during a step: 4 bytes per element at
the peak, counted in the planner's totals; 2 bytes between steps. Casts keep none, nor do gathers.
"""

import math
from dataclasses import dataclass

# the choices of zerokern/zero/comm/wire.py (REDUCE_PRECISIONS, GATHER_PRECISIONS), repeated here
# so that the planner imports no torch; tests/plan/test_plan_wire.py checks that they match
REDUCE_PRECISIONS = (None, "fp32", "bf16", "int8", "int4")
GATHER_PRECISIONS = (None, "int8")
BLOCK = 64  # elements per fp32 scale (kernels/wire.py's BLOCK; a test checks they agree)
CAST_BYTES = {"fp32": 4, "bf16": 2}
RESIDUAL_BYTES = 2  # bf16, committed and pending: [Note: error feedback memory]


def check_precisions(reduce_precision, gather_precision) -> None:
    """A ValueError naming the choices for a value that is not one."""
    if reduce_precision not in REDUCE_PRECISIONS:
        raise ValueError(f"unknown reduce_precision {reduce_precision!r}; choose one of {REDUCE_PRECISIONS} (None: "
                         "the grads' own dtype)")
    if gather_precision not in GATHER_PRECISIONS:
        raise ValueError(f"unknown gather_precision {gather_precision!r}; choose one of {GATHER_PRECISIONS} (None: "
                         "the params' own dtype)")


def quantized(precision) -> bool:
    return precision in ("int8", "int4")


def wire_bytes(n: float, precision, dtype_bytes: float) -> float:
    """Bytes of n elements on the wire ([Note: bytes on the wire]); a quantized chunk is whole."""
    if precision is None:
        return dtype_bytes * n
    if precision in CAST_BYTES:
        return CAST_BYTES[precision] * n
    n = math.ceil(n)
    return -(-(4 * -(-n // BLOCK) + (n if precision == "int8" else -(-n // 2))) // 4) * 4


@dataclass(frozen=True)
class Traffic:
    """Bytes per step: one rank's sends, and all ranks' sends to other hosts and within their host."""
    per_rank: float = 0.0
    across: float = 0.0
    within: float = 0.0

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.per_rank + other.per_rank, self.across + other.across, self.within + other.within)

    def __mul__(self, k: float) -> "Traffic":
        return Traffic(k * self.per_rank, k * self.across, k * self.within)


def _ring(sent: float, g: int, hosts: int, groups: int = 1) -> Traffic:
    """`groups` rings of g ranks on `hosts` hosts each, every rank sending `sent` to the next."""
    across = hosts * sent if hosts > 1 else 0.0
    return Traffic(sent, groups * across, groups * (g * sent - across))


def _all_to_all(chunk: float, g: int, per_host: int, groups: int = 1) -> Traffic:
    """`groups` groups of g ranks (per_host of them on each host), every rank sending `chunk`
    bytes to each other rank of its group."""
    return Traffic((g - 1) * chunk, groups * g * (g - per_host) * chunk, groups * g * (per_host - 1) * chunk)


def _reduction(all_reduce: bool, params: float, b: float, g: int, hosts: int, precision, groups: int = 1) -> Traffic:
    """A SUM reduce-scatter (all_reduce False) or all-reduce of `params` elements over `groups`
    groups of g ranks spread over `hosts` hosts each."""
    if g == 1:
        return Traffic()
    if not quantized(precision):
        return _ring((2 if all_reduce else 1) * (g - 1) / g * wire_bytes(params, precision, b), g, hosts, groups)
    chunk = wire_bytes(params / g, precision, b)
    if all_reduce and g == 2:
        return _ring(wire_bytes(params, precision, b), g, hosts, groups)
    scatter = _all_to_all(chunk, g, g // hosts, groups)
    return scatter + _ring((g - 1) * chunk, g, hosts, groups) if all_reduce else scatter


def _gathers(stage: int, params: float, b: float, g: int, hosts: int, precision, groups: int = 1) -> Traffic:
    """The param all-gathers of a step: stages 1/2 one after step, stage 3 two per unit."""
    if stage == 0 or g == 1:
        return Traffic()
    shard = params / g if precision is None else math.ceil(params / g)
    return _ring((g - 1) * wire_bytes(shard, precision, b), g, hosts, groups) * (2 if stage == 3 else 1)


def flat(stage: int, params: float, b: float, dp: int, hosts: int, reduce_precision=None,
         gather_precision=None) -> Traffic:
    """One group of dp ranks ([Note: bytes on the wire])."""
    return (_reduction(stage == 0, params, b, dp, hosts, reduce_precision)
            + _gathers(stage, params, b, dp, hosts, gather_precision))


def hybrid(stage: int, params: float, b: float, dp: int, hosts: int, reduce_precision=None) -> Traffic:
    """mesh=(hosts, dp / hosts): within a host in the grads' and params' dtype, the replica
    all-reduce across hosts in reduce_precision ([Note: bytes on the wire])."""
    s = dp // hosts
    inside = _reduction(stage == 0, params, b, s, 1, None, groups=hosts) + _gathers(stage, params, b, s, 1, None,
                                                                                    groups=hosts)
    replica = _reduction(True, params if stage == 0 else params / s, b, hosts, hosts, reduce_precision, groups=s)
    return inside + replica


def error_feedback_bytes(stage: int, params: float, dp: int, hosts: int, reduce_precision, is_hybrid: bool,
                         between_steps: bool = False) -> float:
    """Per GPU ([Note: error feedback memory]): at the peak of a step, or between steps."""
    if not quantized(reduce_precision) or dp == 1:
        return 0.0
    if is_hybrid:
        sent, g = (params if stage == 0 else params / (dp // hosts)), hosts
    else:
        sent, g = params, dp
    summed = math.ceil(sent / g) if g > 2 and (stage == 0 or is_hybrid) else 0
    return RESIDUAL_BYTES * (1 if between_steps else 2) * (sent + summed)
