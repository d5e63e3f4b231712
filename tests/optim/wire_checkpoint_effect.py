"""What resuming a quantized-reduction run from a checkpoint costs in loss, per world-size change
([Note: error feedback in checkpoints] in zerokern/optim/wire_checkpoint.py). Not a test: run
`python tests/optim/wire_checkpoint_effect.py` (about 40 s a row on 2 cores).

Each row trains N steps at the saving layout, saves with DCP, and trains M more ("after"); a
fresh run at the loading layout loads and trains the same M steps, with the error feedback
restored ("resumed") or dropped after the load ("dropped"). Printed: the largest relative loss
difference from "after" over the M steps, and, for scale, that of an uninterrupted run at the
loading layout (its quantization noise differs from step 1 on)."""

import shutil
import sys
import tempfile

_HERE = __file__.rsplit("/", 1)[0]
sys.path[:0] = [_HERE, _HERE.rsplit("/", 1)[0]]  # its workers, then tests/ (dist_harness, models)

import dist_harness  # noqa: E402
import wire_checkpoint_workers as W  # noqa: E402

N, M = 3, 4
ROWS = [  # (save world, save mesh, load world, load mesh, stage, precision)
    (2, None, 2, None, 2, "int8"),
    (2, None, 4, None, 2, "int8"),
    (2, None, 1, None, 2, "int8"),
    (4, (2, 2), 4, None, 2, "int8"),
    (4, None, 4, (2, 2), 3, "int8"),
    (2, None, 2, None, 2, "int4"),
    (2, None, 4, None, 2, "int4"),
]


def _rel(a, b):
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


def main():
    print("save -> load, stage, precision: resumed | dropped | uninterrupted at the loading layout")
    for sw, sm, lw, lm, stage, prec in ROWS:
        path = tempfile.mkdtemp()
        try:
            after = dist_harness.values(dist_harness.run(W.save_run, sw, path, stage, prec, sm, N, M,
                                                         timeout=300))[0]["after"]
            got = [dist_harness.values(dist_harness.run(W.load_run, lw, path, stage, prec, lm, N, M, forget,
                                                        timeout=300))[0]["resumed"] for forget in (False, True)]
            other = dist_harness.values(dist_harness.run(W.uninterrupted, lw, stage, prec, lm, N, M,
                                                         timeout=300))[0]
        finally:
            shutil.rmtree(path)
        name = lambda w, m: f"{w}" + (f" ({m[0]}x{m[1]})" if m else "")  # noqa: E731
        print(f"{name(sw, sm)} -> {name(lw, lm)}, stage {stage}, {prec}: "
              f"{_rel(after, got[0]):.1e} | {_rel(after, got[1]):.1e} | {_rel(after, other):.1e}", flush=True)


if __name__ == "__main__":
    main()
