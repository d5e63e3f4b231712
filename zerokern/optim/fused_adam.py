"""FusedAdam: zerokern's fused kernel as a plain torch.optim.Optimizer.

No sharding, no hooks, no collectives, no flattening of its own: it updates
whatever param_groups hold when step() runs. That is what DeepSpeed ZeRO needs
from a client optimizer (it flattens, partitions, reduces, unscales and clips
itself, then calls step() on its fp32 partitions), and what a single process
needs from a fast Adam.
"""

import torch

from ..kernels.ops import fused_adam_
from ..zero.comm import exit_drain
from .hyper import check_hyper as _check_hyper


class FusedAdam(torch.optim.Optimizer):
    """Adam/AdamW (adam_w_mode) in one fused pass per call over all params.

    State per param, under the keys torch.optim.Adam, DeepSpeed checkpoints
    and its universal checkpoint use: "step" (a float32 tensor), "exp_avg",
    "exp_avg_sq" (fp32). fp16/bf16 params also get "master_param" (fp32),
    made from the param at its first step; the kernel writes the rounded
    result back to the param in the same pass.
    """

    _step_supports_amp_scaling = True  # torch.amp.GradScaler hands over grad_scale and found_inf

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *, adam_w_mode=True,
                 bias_correction=True, backend="auto"):
        _check_hyper(lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adam_w_mode=adam_w_mode,
                        bias_correction=bias_correction)
        super().__init__(params, defaults)
        self.backend = backend
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            exit_drain.register()  # DeepSpeed's gloo collectives, with or without register()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and found_inf.item():
            # GradScaler saw an inf/nan: skip, and no step counter moves. Reading the
            # flag is the one host sync per step GradScaler's own path makes too.
            return loss
        for group in self.param_groups:
            _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            calls = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise TypeError("FusedAdam does not support sparse gradients")
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                    if p.dtype != torch.float32:
                        st["master_param"] = p.detach().float()
                step = int(st["step"].item()) + 1
                st["step"].fill_(step)
                low = p.dtype != torch.float32
                key = (p.device, step, low)
                lists = calls.setdefault(key, ([], [], [], [], []))
                master = st["master_param"] if low else p
                for lst, t in zip(lists, (master, p.grad, st["exp_avg"], st["exp_avg_sq"], p)):
                    lst.append(t)
            for (_, step, low), (ps, gs, ms, vs, models) in calls.items():
                fused_adam_(ps, [g if g.is_contiguous() else g.contiguous() for g in gs], ms, vs, lr=group["lr"],
                            beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                            weight_decay=group["weight_decay"], step=step, adam_w_mode=group["adam_w_mode"],
                            bias_correction=group["bias_correction"], grad_scale=grad_scale,
                            model_params=models if low else None, backend=self.backend)
        return loss
