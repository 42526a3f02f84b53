"""The n-gram (prompt lookup) proposer: which continuation it proposes."""

from __future__ import annotations

import pytest

from pagoda.config import SpeculativeConfig
from pagoda.errors import ConfigError
from pagoda.plugins.spec_decode.ngram import NgramProposer, ngram_lookup


def test_the_longest_matching_tail_wins_over_shorter_ones():
    # tail [1, 2, 3]: the 3-gram occurs at 0 (followed by 7); the 1-gram [3] also occurs at 5 (followed by 9)
    tokens = [1, 2, 3, 7, 8, 3, 9, 1, 2, 3]
    assert ngram_lookup(tokens, 3, 1, 2) == [7, 8]


def test_the_latest_match_with_a_full_continuation_is_used():
    tokens = [5, 1, 2, 5, 3, 4, 6, 6, 5]
    assert ngram_lookup(tokens, 2, 1, 2) == [3, 4]  # the match at 3 beats the one at 0
    # a periodic tail: the latest occurrence has too few tokens after it, an earlier one has enough
    assert ngram_lookup([1, 2, 1, 2, 1, 2], 2, 1, 3) == [1, 2, 1]


def test_no_match_proposes_nothing_and_min_n_is_respected():
    assert ngram_lookup([1, 2, 3, 4], 3, 1, 4) == []
    assert ngram_lookup([9, 1, 5, 2, 1], 3, 2, 2) == []  # only a 1-gram [1] matches
    assert ngram_lookup([9, 1, 5, 2, 1], 3, 1, 2) == [5, 2]
    assert ngram_lookup([4], 3, 1, 2) == []


def test_lookup_bounds_are_checked():
    config = SpeculativeConfig("ngram", 4, prompt_lookup_max=1, prompt_lookup_min=3)
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        NgramProposer(config, None)


def test_the_ngram_proposer_meets_the_proposer_interface():
    from pagoda import interfaces

    assert isinstance(NgramProposer(SpeculativeConfig("ngram", 2), None), interfaces.Proposer)
