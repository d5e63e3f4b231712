"""What grads and gathered params may travel in (reduce_precision, gather_precision), checked at
the boundary. The collectives that use them are comm/wire.py's ([Note: quantized reductions])."""

REDUCE_PRECISIONS = (None, "fp32", "bf16", "int8", "int4")
GATHER_PRECISIONS = (None, "int8")


def check_precisions(reduce_precision, gather_precision) -> None:
    """A ValueError naming the choices for a value that is not one."""
    if reduce_precision not in REDUCE_PRECISIONS:
        raise ValueError(f"zerokern: reduce_precision={reduce_precision!r}; choose one of {REDUCE_PRECISIONS} (None: "
                         "the grads' own dtype)")
    if gather_precision not in GATHER_PRECISIONS:
        raise ValueError(f"zerokern: gather_precision={gather_precision!r}; choose one of {GATHER_PRECISIONS} "
                         "(None: the params' own dtype)")
