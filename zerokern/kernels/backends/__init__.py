"""Kernel backends behind zerokern.ops: each one states where it runs and can
say why it cannot (see registry.py)."""
