"""Environment variables are parsed one way: booleans, choices and numbers, with errors that say what to set."""

import pytest

from pagoda.errors import ConfigError
from pagoda.host.env import env_bool, env_choice, env_number, parse_bool, parse_choice, parse_number


@pytest.mark.parametrize("word", ["1", "true", "True", "TRUE", "yes", "Yes", "on", "ON", " on "])
def test_every_spelling_of_on_is_true(word):
    assert parse_bool(word, "PAGODA_X") is True


@pytest.mark.parametrize("word", ["0", "false", "False", "FALSE", "no", "NO", "off", "Off"])
def test_every_spelling_of_off_is_false(word):
    assert parse_bool(word, "PAGODA_X") is False


@pytest.mark.parametrize("word", ["2", "enabled", "nope", "tru"])
def test_anything_else_is_an_error_naming_the_variable_and_the_accepted_words(word):
    with pytest.raises(ConfigError) as info:
        parse_bool(word, "PAGODA_HUGE_PAGES")
    message = str(info.value)
    assert message.startswith(f"PAGODA_HUGE_PAGES={word!r} is not a boolean")
    for accepted in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        assert accepted in message
    assert "unset it" in message


def test_an_unset_or_empty_variable_takes_the_default(monkeypatch):
    monkeypatch.delenv("PAGODA_TEST_FLAG", raising=False)
    assert env_bool("PAGODA_TEST_FLAG", True) is True
    monkeypatch.setenv("PAGODA_TEST_FLAG", "")
    assert env_bool("PAGODA_TEST_FLAG", False) is False
    assert env_choice("PAGODA_TEST_FLAG", ("a", "b"), "b") == "b"
    assert env_number("PAGODA_TEST_FLAG", int, 1, None) is None
    monkeypatch.setenv("PAGODA_TEST_FLAG", "off")
    assert env_bool("PAGODA_TEST_FLAG", True) is False


def test_a_choice_is_matched_in_any_case_and_an_unknown_one_lists_the_choices():
    assert parse_choice("AVX2", "PAGODA_CPU_ISA", ("auto", "avx2")) == "avx2"
    with pytest.raises(ConfigError, match=r"PAGODA_CPU_ISA='avx3' is not one of auto, avx2; set it to one of them"):
        parse_choice("avx3", "PAGODA_CPU_ISA", ("auto", "avx2"))


def test_numbers_are_checked_for_kind_and_minimum():
    assert parse_number("3", "PAGODA_CPU_THREADS", int, 1) == 3
    assert parse_number("0.5", "PAGODA_THREAD_RECHECK_SECONDS", float, 0.0) == 0.5
    with pytest.raises(ConfigError, match=r"PAGODA_CPU_THREADS='two' is not a whole number >= 1"):
        parse_number("two", "PAGODA_CPU_THREADS", int, 1)
    with pytest.raises(ConfigError, match=r"PAGODA_CPU_THREADS='0' is not a whole number >= 1"):
        parse_number("0", "PAGODA_CPU_THREADS", int, 1)
    with pytest.raises(ConfigError, match=r"PAGODA_THREAD_RECHECK_SECONDS='-1' is not a number >= 0"):
        parse_number("-1", "PAGODA_THREAD_RECHECK_SECONDS", float, 0.0)
