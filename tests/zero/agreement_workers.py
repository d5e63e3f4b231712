"""Per-rank bodies of test_agreement.py: options that shape collectives or decisions, given
differently on the ranks (issue 12, case 5)."""

import torch

from zerokern import FusedZeroAdam


def options_differ(rank, world, what):
    """Build FusedZeroAdam with `what` different on the last rank; the error (or None)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    odd = rank == world - 1
    kwargs = {"bucket_cap_mb": {"bucket_cap_mb": 1e-4 if odd else 25.0},
              "max_grad_norm": {"max_grad_norm": 1.0 if odd else None},
              "overlap_comm": {"overlap_comm": not odd},
              "zero_stage": {"zero_stage": 1 if odd else 2},
              "adam_w_mode": {"adam_w_mode": not odd}}.get(what, {})
    params = list(model.parameters())
    if what == "groups":  # the same params, split into param groups differently
        cut = 1 if odd else 2
        params = [{"params": params[:cut]}, {"params": params[cut:]}]
    try:
        opt = FusedZeroAdam(params, lr=1e-2, **kwargs)
    except ValueError as e:
        return str(e)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    return None
