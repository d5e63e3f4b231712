"""A stage-3 param between gathers refuses to be computed with, naming itself and the fix.

[Note: reads between gathers] Between its unit's forward and backward a stage-3 param holds an
empty tensor ([Note: stage-3 params]). Code that reads it there (hidden states from a method that
is not a forward, `x @ model.head.weight.t()` with the head never called, an L2 term summed over
the params) used to fail on torch's shape checks ("vec (0)", "PowBackward0 returned an invalid
gradient ... got [0]"), or worse, silently added 0 (the sum of an empty tensor). So while the
unit is sharded each param's class is swapped for a subclass of its own whose __torch_function__
lets through what reads no values (shape and dtype queries, .data and .grad, detach, to() and
the rest of what Module._apply, state_dict() and copying do) and raises for anything else. The
swap is two attribute writes per param per gather; a gathered param is its own class again, so a
forward pays nothing. The subclass also answers shape queries with the param's full shape
([Note: shapes between gathers] below).
"""

import weakref
from contextlib import contextmanager

import torch
from torch.utils.weak import WeakIdKeyDictionary

# Methods that read no values of the param (or, as to() and detach(), hand on the empty tensor
# to code that checks it later: check_moved at the next gather).
_ALLOWED = {
    "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset", "is_contiguous", "data_ptr",
    "element_size", "is_floating_point", "is_complex", "is_signed", "get_device", "untyped_storage", "_typed_storage",
    "storage", "_is_view", "is_pinned", "is_shared", "share_memory_", "detach", "detach_", "requires_grad_",
    "retain_grad", "register_hook", "register_post_accumulate_grad_hook", "_register_post_accumulate_grad_hook",
    "__repr__", "__format__", "__reduce_ex__", "__deepcopy__", "__setstate__", "__hash__", "__len__", "_version",
    "to", "cpu", "cuda", "type", "float", "half", "bfloat16", "double", "_has_compatible_shallow_copy_type",
    "is_set_to", "_is_zerotensor", "_fix_weakref", "__dlpack_device__", "_nested_tensor_size", "dim_order",
    "__get__", "__set__", "__delete__", "_make_subclass", "module_load",
}

# Properties whose value is computed from the param's values (a transpose, a view of them): a
# property read reaches __torch_function__ as its __get__, which _ALLOWED lets through for the
# metadata ones (shape, grad, data), so these are told apart by the property's name.
_VALUE_PROPERTIES = {"T", "mT", "H", "mH", "real", "imag"}

_WHERE = WeakIdKeyDictionary()  # param -> (weakref to its FlatParams, its index there, its full shape)
_CLASSES = {}  # a param class -> its sharded subclass
_SHARDED = set()  # those subclasses
_passing = [0]  # > 0: everything goes through (a root's init at shard(), checked there afterwards)


@contextmanager
def let_through():
    """Computing with empty params is let through (a root's init= at shard() writes to the units
    inside it; params/materialize.py checks those writes by their version counters afterwards)."""
    _passing[0] += 1
    try:
        yield
    finally:
        _passing[0] -= 1


def _name(param) -> str:
    flat_ref, i, _ = _WHERE.get(param, (lambda: None, 0, None))
    flat = flat_ref()
    return flat.members[i].name if flat is not None else "a stage-3 param"


def _refuse(func, param, op=None):
    name = _name(param)
    op = op or getattr(func, "__name__", str(func))
    if op.endswith("_") and not op.startswith("_"):  # in place: clamp_, copy_, an nn.init call
        return RuntimeError(
            f"zerokern: {name} was changed in place ({op}) outside its unit's forward and backward, where at "
            "stage 3 it holds no values (each rank keeps its slice), so the change would do nothing. To set new "
            "weights between steps, load them: model.load_state_dict(sd) takes whole tensors into the shards")
    return RuntimeError(
        f"zerokern: {name} was used ({op}) outside its unit's forward and backward, where at stage 3 it holds no "
        "values (each rank keeps its slice). Use it inside a forward: call the module (model.head(x), not "
        "x @ model.head.weight.t()), add a penalty over params in their unit's forward (or use weight_decay), and "
        "read weights between steps with zerokern.full_state_dict(model)")


def held_shape(param: torch.Tensor) -> torch.Size:
    """The shape of the tensor param holds now ([0] between gathers), whatever param.shape says."""
    if type(param) not in _SHARDED:
        return param.shape
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.shape.__get__(param)


@torch._dynamo.disable  # compiled code reads it outside the graph, so it gets what eager code gets
def _full_shape(param) -> torch.Size:
    where = _WHERE.get(param)
    # torch.compile's own reads of the tensor (its fake copy, its guards) must see the held one
    if where is None or torch.compiler.is_compiling():  # None: a copy (deepcopy) of a sharded param
        return held_shape(param)
    return where[2]


def _size(self, dim=None):
    shape = _full_shape(self)
    return shape if dim is None else shape[dim]


def _dim(self):
    return len(_full_shape(self))


def _numel(self):
    return _full_shape(self).numel()


def _nbytes(self):
    return _numel(self) * self.element_size()


def _repr(self):
    return (f"{type(self).__mro__[1].__name__}({_name(self)} sharded by zerokern: its values live inside its unit's forward "
            f"and backward, shape={list(_full_shape(self))}, dtype={self.dtype}, device={self.device}, "
            f"requires_grad={self.requires_grad})")


# [Note: shapes between gathers] A sharded param reports its full shape to Python (p.shape,
# p.size(), p.dim(), p.ndim, p.numel(), len(p), p.nbytes), as FSDP2's DTensor params do: a script that
# counts params or picks decay groups by p.dim() >= 2 after shard() gets what it got before.
# The C++ tensor stays empty, so torch's own checks (a grad assigned, an op run) see [0]; code
# that needs that shape asks held_shape(p). Only the sharded class has these methods: a gathered
# param is its own class, its shape its data's.
_FULL_SHAPE_METHODS = {
    "shape": property(_full_shape), "ndim": property(_dim), "size": _size, "dim": _dim, "ndimension": _dim,
    "numel": _numel, "nelement": _numel, "nbytes": property(_nbytes), "__repr__": _repr,
}


def _sharded_class(cls):
    sub = _CLASSES.get(cls)
    if sub is None:
        def __torch_function__(klass, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name == "__get__":  # a property read: .shape passes, .mT computes from the values
                prop = getattr(getattr(func, "__self__", None), "__name__", "")
                name = prop if prop in _VALUE_PROPERTIES else name
            # dynamo's tracing inspects params (is_conj, fake copies) and runs zerokern's hooks:
            # left to it (a compiled graph that computes with an empty param fails on its shape)
            if (name not in _ALLOWED and not name.startswith(("is_", "_is_")) and not _passing[0]
                    and not torch.compiler.is_compiling()):
                for a in list(args) + list((kwargs or {}).values()):
                    for x in (a if isinstance(a, (list, tuple)) else (a,)):  # torch.cat([w, ...]), _foreach_*
                        if type(x) in _SHARDED:
                            raise _refuse(func, x, name)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        # run eagerly, never traced: dynamo inlining it lost the DisableTorchFunctionSubclass
        # guard below and recursed
        sub = _CLASSES[cls] = type(f"Sharded{cls.__name__}", (cls,), {
            "__torch_function__": classmethod(torch._dynamo.disable(__torch_function__)),
            **_FULL_SHAPE_METHODS,
            "__doc__": "A stage-3 param between gathers ([Note: reads between gathers] in zero/params/empty.py)."})
        _SHARDED.add(sub)
    return sub


def mark_empty(param: torch.Tensor, flat, i: int) -> None:
    """param now holds its empty placeholder: computing with it raises, naming flat.members[i].name."""
    if isinstance(param, torch.nn.Parameter) and type(param) not in _SHARDED:
        if param not in _WHERE:  # a param stays at its place in its FlatParams
            _WHERE[param] = (weakref.ref(flat), i, flat.members[i].shape)
        param.__class__ = _sharded_class(type(param))


def mark_full(param: torch.Tensor) -> None:
    """param views its gathered values again: its own class back."""
    cls = type(param)
    if cls in _SHARDED:
        param.__class__ = cls.__mro__[1]
