"""Glue to other training frameworks (imported on demand; none is a dependency)."""
