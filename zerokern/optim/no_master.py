"""ZeroOptimizer(..., master_weights=False): bf16 params trained without an fp32 master copy (issue
51, item 7), for any of its torch optimizers, Muon's and Adafactor's groups too.

[Note: bf16 params without masters] With master_weights=True (the default) a bf16 param's shard
has an fp32 master in its store; the inner torch optimizer steps views of it ("pieces") and the
bf16 params are the masters rounded to nearest after each step. With master_weights=False the
store keeps no master (ShardStore(master_weights=False): its master IS the bf16 param shard), so
the pieces are bf16 views of the params themselves, and their grads the reduced bf16 grads. The
inner torch optimizer then does what it does on a bf16 model on one process: it keeps its state
in the param's dtype (AdamW's exp_avg and exp_avg_sq, Muon's momentum_buffer, Adafactor's row
and column variances in bf16; step counters as torch keeps them) and rounds each op to nearest
bf16. So with every rank on the same batch the params and state are torch's on a one-process
bf16 model bit for bit (tests/optim/test_zero_optimizer_no_master.py), which is what a user
switching from a plain bf16 run expects, and the state dict is that run's (bf16 tensors).
Bytes per element a rank holds: fp32 master 4 -> 0, and the state at 2 a value instead of 4
(master + state: AdamW 12 -> 4, Muon 8 -> 2; docs/matrix_optimizers.md has the measured table).

How it differs from FusedZeroAdam(master_weights=False): that kernel reads bf16 params and
moments into fp32 registers, updates there, and writes the param back with stochastic rounding
(keyed by rounding_seed), so an update smaller than half a bf16 ulp still moves the param in
expectation. Here torch's ops round to nearest: such an update is lost, as in torch on bf16
(AdamW's step is about lr; with lr 1e-3, below half an ulp, 2^-9, of a weight between 0.5 and 1,
so such weights stop moving). No rounding_seed is taken: there is no randomness to seed.

Refused at construction, on every rank alike, naming the param or option: fp32 and fp16 params
(FusedZeroAdam's errors: lowbit_options.check_bf16_params), OffloadPolicy (an offloaded shard is
stepped from an fp32 copy off the device, the very master this drops: engine), quantized param
gathers at stages 1-2 (the params hold the gathered values, not what was trained: engine), a
Muon group's "state_precision": "int8" (its codec decodes to an fp32 momentum; not built for
bf16 yet), and rounding_seed. GradScaler and clipping work: the grad is unscaled and clipped in
fp32 and rounded to bf16 once ([Note: the grad of a piece] in ZeroOptimizer._update); torch's
clip_grad_norm_ on a bf16 model multiplies the bf16 grads by the coefficient instead, so a
clipped step may differ from it by an ulp of a grad.
"""

from . import lowbit_momentum
from .lowbit_options import check_bf16_params

OPTION = "master_weights"


def popped(kwargs):
    """Take master_weights out of ZeroOptimizer's **kwargs (True when not given), checked; refuse
    FusedZeroAdam's rounding_seed, which has no meaning here."""
    master_weights = kwargs.pop(OPTION, True)
    if not isinstance(master_weights, bool):
        raise TypeError(f"ZeroOptimizer: master_weights must be True or False, got {master_weights!r}")
    if "rounding_seed" in kwargs:
        raise ValueError("ZeroOptimizer: rounding_seed is FusedZeroAdam's (its stochastic rounding of bf16 params); "
                         "ZeroOptimizer(master_weights=False) rounds to nearest as torch's optimizers do on bf16 "
                         "params ([Note: bf16 params without masters] in optim/no_master.py). Drop rounding_seed, or "
                         "train with zerokern.FusedZeroAdam(master_weights=False, rounding_seed=...)")
    return master_weights


def check(engine, names, groups):
    """After the engine is built (it knows each param's name): every trainable param bf16, and no
    Muon group with int8 momentum. groups: ZeroOptimizer's param groups."""
    check_bf16_params(engine, names)
    for gi, g in enumerate(groups):
        if g.get(lowbit_momentum.OPTION) == "int8":
            raise ValueError(f"ZeroOptimizer: param group {gi} has state_precision='int8' and master_weights=False: "
                             "int8 Muon momentum beside bf16 params without masters is not offered yet (its codec "
                             "decodes to an fp32 momentum). Drop one of them: master_weights=False alone keeps the "
                             "momentum in bf16, 2 bytes an element")

