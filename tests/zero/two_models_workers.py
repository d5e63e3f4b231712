"""Per-rank bodies of tests/zero/test_two_models.py: PyTorch's DCGAN tutorial loop, where G's backward
goes through D and so reaches D's params after D's step(), under zerokern and under DDP."""

import copy

import torch
import torch.distributed as dist

import zerokern

NZ, BATCH, ITERS, LR = 4, 6, 4, 2e-3


def _nets():
    torch.manual_seed(0)
    g = torch.nn.Sequential(torch.nn.ConvTranspose2d(NZ, 8, 4, 1, 0, bias=False), torch.nn.BatchNorm2d(8),
                            torch.nn.ReLU(), torch.nn.ConvTranspose2d(8, 1, 4, 2, 1, bias=False), torch.nn.Tanh())
    d = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 4, 2, 1, bias=False), torch.nn.LeakyReLU(0.2),
                            torch.nn.Conv2d(8, 1, 4, 1, 0, bias=False), torch.nn.Sigmoid())
    return d, g  # G: noise (NZ, 1, 1) -> an 8 x 8 image; D: an image -> a probability


def _clear(net, how):
    """The three ways the README says clear a model's grads, none of them the optimizer's zero_grad()."""
    if how == "module":
        net.zero_grad()
    elif how == "none":
        for p in net.parameters():
            p.grad = None
    else:
        net.zero_grad(set_to_none=False)


def _loop(netD, netG, optD, optG, rank, how):
    """The tutorial's iteration (pytorch.org/tutorials/beginner/dcgan_faces_tutorial.html): D on a
    real and a detached fake batch, D's step, then G through D (D's params get grads again), G's step."""
    criterion = torch.nn.BCELoss()
    gen = torch.Generator().manual_seed(100 + rank)
    fixed_noise = torch.randn(BATCH, NZ, 1, 1, generator=gen)
    losses = []
    for _ in range(ITERS):
        real = torch.rand(BATCH, 1, 8, 8, generator=gen) * 2 - 1
        _clear(netD, how)
        label = torch.full((BATCH,), 1.0)
        errD_real = criterion(netD(real).view(-1), label)
        errD_real.backward()
        fake = netG(torch.randn(BATCH, NZ, 1, 1, generator=gen))
        label.fill_(0.0)
        errD_fake = criterion(netD(fake.detach()).view(-1), label)
        errD_fake.backward()
        optD.step()
        _clear(netG, how)
        label.fill_(1.0)
        errG = criterion(netD(fake).view(-1), label)
        errG.backward()
        optG.step()
        with torch.no_grad():
            netG(fixed_noise)
        losses.append([(errD_real + errD_fake).item(), errG.item()])
    return losses


def dcgan_against_ddp(rank, world, stage):
    """The loop under zerokern at `stage` (both models; at 3 each sharded with zerokern.shard) and
    under DDP + torch.optim.Adam, once for each way of clearing grads. Returns per way the largest
    difference of the losses and of the final params (rank 0; the params gathered at stage 3)."""
    out = {}
    for how in ("module", "none", "zeros"):
        d0, g0 = _nets()
        ddpD, ddpG = (torch.nn.parallel.DistributedDataParallel(copy.deepcopy(m)) for m in (d0, g0))
        ref_losses = _loop(ddpD, ddpG, torch.optim.Adam(ddpD.parameters(), lr=LR, betas=(0.5, 0.999)),
                           torch.optim.Adam(ddpG.parameters(), lr=LR, betas=(0.5, 0.999)), rank, how)
        netD, netG = _nets()
        kw = {}
        if stage == 3:
            zerokern.shard(netD, stage=3)
            zerokern.shard(netG, stage=3)
        else:
            kw = {"zero_stage": stage}
        optD = zerokern.FusedZeroAdam(netD.parameters(), lr=LR, betas=(0.5, 0.999), **kw)
        optG = zerokern.FusedZeroAdam(netG.parameters(), lr=LR, betas=(0.5, 0.999), **kw)
        losses = _loop(netD, netG, optD, optG, rank, how)
        diff = max(abs(a - b) for la, lb in zip(losses, ref_losses) for a, b in zip(la, lb))
        params = 0.0
        for net, ref in ((netD, ddpD.module), (netG, ddpG.module)):
            full = zerokern.full_state_dict(net)
            if rank == 0:
                want = dict(ref.named_parameters())
                params = max(params, max((full[n] - want[n].detach()).abs().max().item() for n in want))
        out[how] = {"losses": diff, "params": params}
        del optD, optG
    dist.barrier()
    return out


def batchnorm_buffers(rank, world, stage):
    """A BatchNorm model trained on each rank's own batches, under DDP (broadcast_buffers=True, its
    default) and under zerokern with and without zerokern.broadcast_buffers(model) (no bias before the
    BatchNorm: its grad is rounding noise, which Adam would turn into lr-sized steps). Per variant:
    the largest difference of this rank's running stats and eval output from DDP's on this rank."""
    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 8, bias=False), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                   torch.nn.Linear(8, 2))

    gen = torch.Generator().manual_seed(7 + rank)
    data = [torch.randn(5, 6, generator=gen) * (1 + rank) + rank for _ in range(4)]
    probe = torch.randn(3, 6, generator=torch.Generator().manual_seed(3))

    def train(model, opt):
        for x in data:
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            out = model(probe)
        inner = model.module if hasattr(model, "module") else model
        return [inner[1].running_mean.clone(), inner[1].running_var.clone()], out

    ddp = torch.nn.parallel.DistributedDataParallel(net())
    ref_stats, ref_out = train(ddp, torch.optim.Adam(ddp.parameters(), lr=1e-2))
    res = {}
    for variant in ("plain", "broadcast"):
        model = net()
        if stage == 3:
            zerokern.shard(model, stage=3)
        if variant == "broadcast":
            zerokern.broadcast_buffers(model)
        kw = {} if stage == 3 else {"zero_stage": stage}
        opt = zerokern.FusedZeroAdam(model.parameters(), lr=1e-2, **kw)
        stats, out = train(model, opt)
        res[variant] = {"stats": max((a - b).abs().max().item() for a, b in zip(stats, ref_stats)),
                        "eval": (out - ref_out).abs().max().item()}
        del opt
    return res
