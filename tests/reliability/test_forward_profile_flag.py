"""``DMUON_RECORD_FORWARD_PROFILE`` is read by the shared on/off parser: off unless asked for,
``false`` means off, and a value that is neither raises with the accepted spellings."""

from __future__ import annotations

import pytest

from dmuon.profile import forward_profile_requested


@pytest.mark.parametrize("value", ["0", "false", "False", "no", "off", ""])
def test_an_off_spelling_or_an_empty_value_leaves_the_forward_profile_off(monkeypatch, value):
    monkeypatch.setenv("DMUON_RECORD_FORWARD_PROFILE", value)
    assert forward_profile_requested() is False


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_an_on_spelling_records_the_forward_profile(monkeypatch, value):
    monkeypatch.setenv("DMUON_RECORD_FORWARD_PROFILE", value)
    assert forward_profile_requested() is True


def test_the_forward_profile_is_off_when_the_variable_is_unset(monkeypatch):
    monkeypatch.delenv("DMUON_RECORD_FORWARD_PROFILE", raising=False)
    assert forward_profile_requested() is False


def test_a_value_that_is_neither_on_nor_off_raises_naming_the_variable(monkeypatch):
    monkeypatch.setenv("DMUON_RECORD_FORWARD_PROFILE", "enabled")
    with pytest.raises(
        ValueError,
        match=r"DMUON_RECORD_FORWARD_PROFILE='enabled' is not an on/off value: use one of 1, "
        r"true, yes, on \(on\) or 0, false, no, off \(off\), any case, or unset it for the "
        r"default \(off\)",
    ):
        forward_profile_requested()
