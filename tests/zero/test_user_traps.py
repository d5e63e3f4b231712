"""What users write around a sharded model (issue 39), on one process: a clear error naming the
param or unit and the fix, never torch's internal one or a silent difference."""

import tempfile

import pytest
import torch
import torch.distributed as dist

import zerokern


class Net(torch.nn.Module):
    def __init__(self, sparse=False):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8, sparse=sparse)
        self.block = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, idx):
        return self.head(torch.tanh(self.block(self.emb(idx)))).square().mean()


def test_a_sparse_embedding_is_refused_naming_the_param_and_the_fix():
    model = Net(sparse=True)
    opt = zerokern.FusedZeroAdam(model.named_parameters(), lr=1e-2, zero_stage=2)
    with pytest.raises(RuntimeError, match=r"emb\.weight got a sparse gradient.*sparse=False"):
        model(torch.randint(0, 16, (4, 3))).backward()
    del opt
    with pytest.raises(ValueError, match=r"zerokern\.shard: emb makes sparse gradients.*sparse=False"):
        zerokern.shard(Net(sparse=True))


@pytest.fixture
def one_rank_group():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_mixed_sharding_options_name_the_field_and_the_units(one_rank_group):
    """One unit sharded over another process group than the rest: the error says which group each
    unit has (it used to list identical ShardConfig lines)."""
    model = Net()
    zerokern.shard(model.block, process_group=dist.new_group([0]))
    zerokern.shard(model.head, bucket_cap_mb=1.0)  # a per-unit option: not a difference
    zerokern.shard(model)
    with pytest.raises(ValueError) as e:
        zerokern.FusedZeroAdam(model.parameters(), lr=1e-2)
    text = str(e.value)
    assert text.endswith("process group: group #0 over ranks [0] (Net, head), group #1 over ranks [0] (block)"), text

    other = Net()
    zerokern.shard(other.block, stage=1)
    zerokern.shard(other)
    with pytest.raises(ValueError, match=r"shard\(\) call: stage: 2 \(Net\), 1 \(block\)$"):
        zerokern.FusedZeroAdam(other.parameters(), lr=1e-2)


def test_a_sharded_param_read_through_a_value_property_names_itself():
    """x @ model.head.weight.mT with the head's unit sharded (stage 3: the param holds an empty
    tensor between gathers) raised torch's "tensor.mT is only supported on matrices"; the value
    properties (.T, .mT, .H, .real) now raise zerokern's error as .t() does, metadata reads pass."""
    from zerokern.zero.params import empty

    p, flat = _sharded(torch.randn(4, 3))
    for read in (lambda: p.mT, lambda: p.T, lambda: p.H, lambda: p.real, lambda: p.t(), lambda: torch.ones(2, 3) @ p.mT):
        with pytest.raises(RuntimeError, match=r"zerokern: head\.weight was used \(\w+\) outside its unit's forward"):
            read()
    assert p.shape == (4, 3) and p.grad is None and p.data.numel() == 0 and p.requires_grad
    empty.mark_full(p)
    assert type(p) is torch.nn.Parameter


class _Flat:  # what mark_empty needs of a FlatParams: the member's name and full shape
    def __init__(self, shape):
        self.members = [type("Member", (), {"name": "head.weight", "shape": torch.Size(shape)})()]


def _sharded(values):
    """A param as a stage-3 unit leaves it between gathers: an empty tensor, its class swapped."""
    from zerokern.zero.params import empty

    flat = _Flat(values.shape)  # kept alive by the caller: the param finds its name through it
    p = torch.nn.Parameter(values)
    p.data = torch.empty(0)
    empty.mark_empty(p, flat, 0)
    return p, flat


def test_a_sharded_param_reports_its_full_shape_as_an_unsharded_one():
    """Issue 39: between gathers p.shape was (0,), so nanoGPT's decay groups (p.dim() >= 2) lost
    every matrix and the param count was 0. Every metadata read now answers as the unsharded
    param (as FSDP2's DTensor params do); the values stay refused, the held tensor empty."""
    import copy

    from zerokern.zero.params import empty

    ref = torch.nn.Parameter(torch.randn(5, 3, 2))
    p, flat = _sharded(ref.detach().clone())
    reads = {
        "shape": lambda t: tuple(t.shape), "size()": lambda t: tuple(t.size()), "size(1)": lambda t: t.size(1),
        "size(-1)": lambda t: t.size(dim=-1), "dim": lambda t: t.dim(), "ndim": lambda t: t.ndim,
        "ndimension": lambda t: t.ndimension(), "numel": lambda t: t.numel(), "nelement": lambda t: t.nelement(),
        "len": len, "nbytes": lambda t: t.nbytes, "dtype": lambda t: t.dtype,
        "requires_grad": lambda t: t.requires_grad,
    }
    assert {k: f(p) for k, f in reads.items()} == {k: f(ref) for k, f in reads.items()}
    assert empty.held_shape(p) == (0,) and p.data.shape == (0,)  # what torch's own checks see
    assert "head.weight sharded by zerokern" in repr(p) and "shape=[5, 3, 2]" in f"{p}", repr(p)
    with pytest.raises(RuntimeError, match=r"zerokern: head\.weight was used \(transpose\)"):
        p.transpose(0, 1)
    # a copy holds its own empty tensor, whose shape it reports
    assert copy.deepcopy(p).shape == (0,)
    # a compiled function reads the full shape too (outside its graph, as in eager)
    fn = torch.compile(lambda x: x.new_full((p.shape[0],), float(p.numel() * p.dim())), backend="eager")
    assert fn(torch.zeros(1)).tolist() == [90.0] * 5
    empty.mark_full(p)
    assert type(p) is torch.nn.Parameter and p.shape == (0,)  # its own class: the data's shape
