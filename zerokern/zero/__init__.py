"""The ZeRO runtime: where params live in flat buckets (layout.py, storage.py),
the units that own them and their hooks (unit.py, api.py), the per-bucket
reduction state (bucket.py, states.py), one collective order per optimizer
(schedule.py), the master weights and Adam state per shard (store.py),
collectives (comm.py) and state dicts (checkpoint.py). docs/DESIGN.md draws it."""

from .api import ZeroModule, full_state_dict, shard, unit_of
from .unit import OffloadPolicy, ShardConfig

__all__ = ["shard", "full_state_dict", "unit_of", "ZeroModule", "OffloadPolicy", "ShardConfig"]
