"""The ZeRO runtime, in wings whose imports point down only (tests/zero/test_layers.py keeps it so):

    api.py, engine.py      zerokern.shard / full_state_dict; the ZeroEngine an optimizer drives
    unit.py                a ShardUnit: one module's params in flat buckets, its hooks, who owns a param
    grads/  params/  state/    gradient buckets and their reduction; param buffers and gathers;
                               the master weights and optimizer state per shard
    comm/                  collectives (Comm, GlooComm, HybridComm) and the collective check
    core/                  pure definitions: the stage (core/stage.py), states, the bucket plan, errors

docs/DESIGN.md draws it. The public names below load on first use, so that importing one
module of a wing does not import the whole runtime.
"""

_PUBLIC = {"shard": "api", "full_state_dict": "api", "ZeroModule": "api", "unit_of": "unit",
           "OffloadPolicy": "core.stage", "ShardConfig": "core.stage"}
__all__ = list(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        import importlib
        value = getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
