"""Rank functions for tests/zero/comm/test_across_hosts.py: the collectives of a group that spans hosts
([Note: collectives across hosts] in zerokern/zero/comm/gloo.py), forced on one machine by
telling the Comm which ranks share a host (GlooComm.place)."""

import os

import torch
import torch.distributed as dist


def _inputs(world, n, dtype, seed):
    """Every rank's reduce-scatter input (each rank can compute all of them)."""
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(seed * 100 + r)
        x = torch.randn(n * world, generator=g) * 10.0 ** torch.randint(-3, 4, (n * world,), generator=g)
        out.append(x.to(dtype))
    return out


def _fixed_order_sum(inputs, hosts, c, n):
    """Chunk c summed in the order the note promises: the ranks of a host in rank order, then the
    hosts in order of their first rank; in the tensors' dtype, one rounding per add."""
    order = list(dict.fromkeys(hosts))
    total = None
    for h in order:
        part = None
        for r in range(len(hosts)):
            if hosts[r] == h:
                x = inputs[r][c * n:(c + 1) * n]
                part = x.clone() if part is None else part.add_(x)
        total = part if total is None else total.add_(part)
    return total


def collectives_bits(rank, world, layouts, sizes, check):
    """For each host layout and size: reduce-scatter against the fixed-order sum (bit for bit) and
    torch's (close), the input kept; all-gather (of an own slice and of a separate tensor) against
    torch's, bit for bit; several collectives in flight at once (launched before the first wait)."""
    os.environ["ZEROKERN_CHECK_COLLECTIVES"] = "1" if check else "0"
    from zerokern.zero.comm.factory import make_comm

    comm = make_comm()
    out = {"spans_by_default": comm.across_hosts, "cases": []}
    for layout in layouts:
        comm.place(layout)
        for n in sizes:
            for dtype in (torch.float32, torch.bfloat16):
                seed = 7 * n + len(out["cases"])
                inputs = _inputs(world, n, dtype, seed)
                full = inputs[rank].clone()
                mine = torch.empty(n, dtype=dtype)
                other = _inputs(world, n, dtype, seed + 1)[rank].clone()  # a second one in flight
                mine2 = torch.empty(n, dtype=dtype)
                gathered = torch.full((n * world,), 7.0, dtype=dtype)
                gathered[rank * n:(rank + 1) * n] = inputs[rank][:n]
                separate = torch.empty(n * world, dtype=dtype)
                works = [comm.reduce_scatter(mine, full),
                         comm.all_gather(gathered, gathered[rank * n:(rank + 1) * n]),
                         comm.reduce_scatter(mine2, other),
                         comm.all_gather(separate, inputs[rank][n:2 * n].clone())]
                for w in works:
                    comm.wait(w)
                ref = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(ref, inputs[rank].clone())
                ref_gather = torch.empty(n * world, dtype=dtype)
                dist.all_gather_into_tensor(ref_gather, inputs[rank][:n].clone())
                ref_separate = torch.empty(n * world, dtype=dtype)
                dist.all_gather_into_tensor(ref_separate, inputs[rank][n:2 * n].clone())
                exact = torch.sum(torch.stack([x[rank * n:(rank + 1) * n].double() for x in inputs]), 0)
                scale = torch.stack([x[rank * n:(rank + 1) * n].double().abs() for x in inputs]).sum(0)
                other_all = _inputs(world, n, dtype, seed + 1)
                out["cases"].append({
                    "layout": layout, "n": n, "dtype": str(dtype),
                    "fixed_order": bool(torch.equal(mine, _fixed_order_sum(inputs, layout, rank, n))),
                    "second_fixed_order": bool(torch.equal(mine2, _fixed_order_sum(other_all, layout, rank, n))),
                    # error against the exact sum, relative to the sum of magnitudes (what rounding bounds)
                    "err": float(((mine.double() - exact).abs() / scale.clamp_min(1e-30)).max()) if n else 0.0,
                    "torch_err": float(((ref.double() - exact).abs() / scale.clamp_min(1e-30)).max()) if n else 0.0,
                    "input_kept": bool(torch.equal(full, inputs[rank])),
                    "gather": bool(torch.equal(gathered, ref_gather)),
                    "gather_separate": bool(torch.equal(separate, ref_separate)),
                })
    from zerokern.zero.comm import gloo
    out["relayed"] = bool(gloo._RELAYS)  # [Note: the relay thread]: made by the first collective across hosts
    return out


def stage3_on_two_hosts(rank, world):
    """stage3_workers.train (tests/zero/params) with the first half of the ranks on one host as the factory sees
    it ([Note: what a host is], this_host faked), so every Comm it makes agrees on 2 hosts."""
    from zerokern.zero.comm import factory, gloo

    factory.this_host = lambda: ("one-machine", f"host{2 * rank // world}")
    import stage3_workers

    out = stage3_workers.train(rank, world, steps=4)
    out["relayed"] = bool(gloo._RELAYS)
    return out
