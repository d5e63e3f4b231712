"""The small models the rank functions train, in one place.

Each seeds torch before it builds its layers, so every rank and the one-process reference start from
the same weights; the tests' measured numbers depend on that seed, the layer sizes and the order the
layers are built in, so change none of them without measuring again."""

import torch
import torch.nn as nn


class TanhStack(nn.Module):
    """Linear blocks with a tanh after each, then a linear head.

    `sizes` are the widths in order (the input's, then each block's output), `out` the head's. With
    `loss=True` forward returns the mean square of the head's output (a scalar to call backward on),
    otherwise the head's output itself."""

    def __init__(self, sizes, out, *, seed, loss):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))
        self.head = nn.Linear(sizes[-1], out)
        self.loss = loss

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        y = self.head(x)
        return y.square().mean() if self.loss else y


class ThreeLayers(nn.Module):
    """Three Linears named a, b and head (6 -> 10 -> 10 -> 1); forward returns the mean square."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.a, self.b, self.head = nn.Linear(6, 10), nn.Linear(10, 10), nn.Linear(10, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x))))).square().mean()


class Flaky(nn.Linear):
    """A Linear that raises (a simulated out-of-memory) in its forward or its backward on demand."""

    fail = None  # None, "forward" or "backward"

    def forward(self, x):
        if self.fail == "forward":
            raise RuntimeError("CUDA out of memory (simulated)")
        out = super().forward(x)
        if self.fail == "backward" and out.requires_grad:
            def boom(grad):
                raise RuntimeError("CUDA out of memory (simulated, in backward)")
            out.register_hook(boom)
        return out


class FlakyStack(nn.Module):
    """Four Flaky blocks of the same size (gathers that one size cannot tell apart) and a head;
    forward can leave blocks out (LayerDrop)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Flaky(8, 8) for _ in range(4)])
        self.head = nn.Linear(8, 1)

    def forward(self, x, skip=()):
        for k, b in enumerate(self.blocks):
            if k not in skip:  # LayerDrop
                x = torch.tanh(b(x))
        return self.head(x).square().mean()


class Poked(nn.Linear):
    """A Linear whose weight's first element gets a grad of `bad` (inf: one element overflows)."""

    bad = 0.0

    def forward(self, x):
        out = super().forward(x)
        return out + self.weight.view(-1)[0] * self.bad if self.bad else out


class BranchNet(nn.Module):
    """`extra` is used only when forward is told to (a conditional branch): on other steps backward
    never reaches it. `a` is Poked, so a test can overflow one of its grad elements."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.a, self.b, self.extra, self.head = Poked(6, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x, use_extra):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        if use_extra:
            h = h + self.extra(h)
        return self.head(h).square().mean()
