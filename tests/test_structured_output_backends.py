"""pagoda.testing.check_structured_output_backend: the built-ins pass it, a backend that masks nothing fails it."""

from __future__ import annotations

import pytest

from pagoda.sampling.structured.xgrammar_backend import XgrammarBackend
from pagoda.testing import ContractError, check_structured_output_backend


class AllowsEverything:
    """A broken matcher: its bitmask allows every token."""

    def __init__(self, inner):
        self.inner = inner

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = -1

    def __getattr__(self, name):
        return getattr(self.inner, name)


class UnmaskedXgrammar(XgrammarBackend):
    def new_matcher(self, compiled):
        return AllowsEverything(super().new_matcher(compiled))


def test_the_xgrammar_backend_meets_the_contract():
    check_structured_output_backend(XgrammarBackend)


def test_a_backend_whose_mask_allows_every_token_fails_the_check():
    with pytest.raises(ContractError, match="end-of-sequence token is allowed|is allowed at the start"):
        check_structured_output_backend(UnmaskedXgrammar)
