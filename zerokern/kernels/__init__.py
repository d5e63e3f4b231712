"""The kernel layer: fused Adam and flat-buffer ops over lists of tensors, one
signature and several backends (ops.py, flat_ops.py, backends/). Nothing here
knows about ranks, buckets or optimizers; zerokern.zero builds on it."""
