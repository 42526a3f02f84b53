"""Deprecated since plugin API 1.0, removed in 1.2: import :mod:`pagoda.step` instead."""

from pagoda.deprecation import deprecated_module

__getattr__ = deprecated_module(__name__)
