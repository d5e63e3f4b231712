"""Per-rank bodies of test_call_trace.py: how many zerokern functions one gradient, or one gather,
walks through (issue 48: a value should travel a short way; FSDP2's grad takes 3 stops in 2 files).

    PYTHONPATH=.:tests python tests/zero/call_trace_workers.py          # the four counts (rank 0)
    PYTHONPATH=.:tests python tests/zero/call_trace_workers.py grad int8  # one walk, stop by stop
"""

import os
import sys

import torch

import zerokern
from zerokern import FusedZeroAdam

ROOT = os.path.dirname(zerokern.__file__) + os.sep


class Walk:
    """sys.setprofile on this thread: every Python function of the zerokern package entered (a
    "stop"), and the files they are in. Threads the runtime started before (the collective check's,
    a relay) are not traced: the count is the caller's walk."""

    def __enter__(self):
        self.calls, self.files, self.names = 0, set(), {}
        self.walk, depth = [], [0]  # each stop, indented by how deep in zerokern it was entered

        def profile(frame, event, arg):
            if not frame.f_code.co_filename.startswith(ROOT):
                return
            if event == "call":
                self.calls += 1
                where = frame.f_code.co_filename[len(ROOT):]
                self.files.add(where)
                key = f"{where}:{frame.f_code.co_name}"
                self.names[key] = self.names.get(key, 0) + 1
                self.walk.append("  " * depth[0] + key)
                depth[0] += 1
            elif event == "return":
                depth[0] -= 1
        sys.setprofile(profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)

    def result(self):
        return {"calls": self.calls, "files": len(self.files), "top": sorted(self.names.items(), key=lambda kv: -kv[1])[:15],
                "walk": self.walk}


def grad_walk(rank, world, precision):
    """One bucket at stage 2 (one Linear, one bucket): its backward and step(), the second time
    round (the first builds buffers and plans)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64)
    opt = FusedZeroAdam(lin.parameters(), lr=1e-2, zero_stage=2, reduce_precision=precision)
    assert len(opt.stores) == 1
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))
    for k in range(2):
        loss = lin(x).square().sum()
        opt.zero_grad()
        if k == 0:
            loss.backward()
            opt.step()
            continue
        with Walk() as w:
            loss.backward()
            opt.step()
    return w.result()


def gather_walk(rank, world, precision):
    """One unit's gather at stage 3: the forward of a model that is one unit, the second time round."""
    torch.manual_seed(0)
    model = zerokern.shard(torch.nn.Sequential(torch.nn.Linear(64, 64)), stage=3, gather_precision=precision)
    opt = FusedZeroAdam(model.parameters(), lr=1e-2)
    x = torch.randn(4, 64)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad(), Walk() as w:
        model(x)
    return w.result()


if __name__ == "__main__":
    import dist_harness
    import call_trace_workers as W  # by module name: the ranks unpickle the function from there

    walks = {"grad": W.grad_walk, "gather": W.gather_walk}
    if len(sys.argv) > 1:
        r = dist_harness.values(dist_harness.run(walks[sys.argv[1]], 2, (sys.argv[2:] or [None])[0]))[0]
        print("\n".join(r["walk"]) + f"\n{r['calls']} calls in {r['files']} files")
    else:
        for name, fn in walks.items():
            for precision in (None, "int8"):
                r = dist_harness.values(dist_harness.run(fn, 2, precision))[0]
                print(f"{name:6} {precision or 'full':4}  {r['calls']:3} calls in {r['files']} files", flush=True)
