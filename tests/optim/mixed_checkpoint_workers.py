"""Bodies of test_zero_mixed_matrix.py's checkpoint test: a ZeroOptimizer with torch.optim.Muon,
torch.optim.Adafactor and AdamW groups (matrix_kinds_workers.py's "mixed" model and groups) at
stage 2 on 2 ranks, saved after SAVE_AT steps, resumed by one-process torch optimizers, and back
on 2 ranks from the dicts those give. Every rank on the same batch, so every run takes the same
steps bit for bit ([Note: one batch on every rank] in test_zero_muon_checkpoint.py)."""

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import matrix_kinds_workers as K
from muon_checkpoint_workers import train as _train, weights as _weights

SAVE_AT, STEPS = 3, 5


def save(rank, world, path):
    """SAVE_AT steps, then opt.state_dict() (a collective: each Muon and Adafactor param's state
    gathered whole from its owner) into dcp.save with the model's, then the rest. Returns the
    uninterrupted run's params, {index: {key: shape}} of the dict's state, and its classes."""
    model, opt = K._built("mixed", 2, None, torch.float32, "optimizer")
    xs = K.U._batches()[:STEPS]
    _train(model, [opt], xs[:SAVE_AT])
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    shapes = {k: {key: list(v.shape) for key, v in st.items()} for k, st in sd["optim"]["state"].items()}
    classes = [g.get("optimizer") for g in sd["optim"]["param_groups"]]
    dcp.save(sd, checkpoint_id=path)
    _train(model, [opt], xs[SAVE_AT:])
    return _weights(model), shapes, classes


def torch_optimizers(model):
    """One-process torch.optim.Muon, Adafactor and AdamW over the model's params, one per group,
    in the ZeroOptimizer's group order (matrix_kinds_workers._groups)."""
    return [g.pop("optimizer", torch.optim.AdamW)(g.pop("params"), **g) for g in K._groups("mixed", model)]


def resume_plain(path, file, again):
    """One process, no zerokern: the checkpoint consolidated by torch's dcp_to_torch_save, each
    group's state loaded into its own torch optimizer, then the rest of the steps (one thread, as
    the ranks: a matmul's sums depend on how it is split over threads). Before stepping on, writes
    to `again` the model's state dict and one dict in torch's layout merged from the three torch
    optimizers' state_dict() (params counted group by group). Returns the params."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dcp_to_torch_save(path, file)
        sd = torch.load(file, weights_only=False)
        model = K.U._net(torch.float32)
        model.load_state_dict(sd["model"])
        opts = torch_optimizers(model)
        params = [p for o in opts for g in o.param_groups for p in g["params"]]
        state = {int(k): v for k, v in sd["optim"]["state"].items()}
        for o, group in zip(opts, sd["optim"]["param_groups"]):
            ids = [int(k) for k in group["params"]]
            # zerokern's AdamW state is saved flattened (each rank's slice: [Note: sharded state in
            # checkpoints]); torch's AdamW keeps the param's shape. Muon's and Adafactor's are whole.
            own = {i: {key: v.view(params[k].shape) if v.dim() == 1 and v.numel() == params[k].numel() else v
                       for key, v in state[k].items()} for i, k in enumerate(ids) if k in state}
            mine = {key: v for key, v in group.items() if key not in ("params", "optimizer")}
            o.load_state_dict({"state": own, "param_groups": [{**mine, "params": list(range(len(ids)))}]})
        merged, groups, base = {}, [], 0
        for o in opts:
            osd = o.state_dict()
            merged.update({base + k: st for k, st in osd["state"].items()})
            groups += [{**g, "params": [base + k for k in g["params"]]} for g in osd["param_groups"]]
            base += sum(len(g["params"]) for g in osd["param_groups"])
        torch.save({"model": model.state_dict(), "optim": {"state": merged, "param_groups": groups}}, again)
        _train(model, opts, K.U._batches()[SAVE_AT:STEPS])
        return _weights(model)
    finally:
        torch.set_num_threads(threads)


def resume_from_torch(rank, world, again):
    """A fresh 2-rank model and ZeroOptimizer load resume_plain's dicts (torch's layout, whole
    tensors: each rank takes its owned params' state and its slices), then the rest of the steps.
    Returns the params."""
    model, opt = K._built("mixed", 2, None, torch.float32, "optimizer")
    sd = torch.load(again, weights_only=False)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    _train(model, [opt], K.U._batches()[SAVE_AT:STEPS])
    return _weights(model)
