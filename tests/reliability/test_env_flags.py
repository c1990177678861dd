"""The one parser of ``DMUON_*`` on/off variables: the spellings it takes, and the message for
one it does not; ``DMUON_NS_CUDA_GRAPH=disabled`` fails instead of meaning on.

Imports dmuon-kernels alone (no dmuon-core), like the kernels it tests; dmuon-core's flag:
``test_forward_profile_flag.py``.
"""

from __future__ import annotations

import pytest

from dmuon_kernels import NewtonSchulz
from dmuon_kernels._env import env_flag
from dmuon_kernels.graphs import cuda_graphs_enabled

FLAG = "DMUON_TEST_FLAG"


@pytest.mark.parametrize("value", ["1", "true", "True", "YES", "on", " On "])
def test_the_on_spellings_turn_a_flag_on_whatever_its_default(monkeypatch, value):
    monkeypatch.setenv(FLAG, value)
    assert env_flag(FLAG, default=False) is True


@pytest.mark.parametrize("value", ["0", "false", "FALSE", "no", "No", "off", " OFF "])
def test_the_off_spellings_turn_a_flag_off_whatever_its_default(monkeypatch, value):
    monkeypatch.setenv(FLAG, value)
    assert env_flag(FLAG, default=True) is False


@pytest.mark.parametrize("default", [True, False])
def test_an_unset_or_empty_variable_means_the_default(monkeypatch, default):
    monkeypatch.delenv(FLAG, raising=False)
    assert env_flag(FLAG, default=default) is default
    for empty in ("", "  "):
        monkeypatch.setenv(FLAG, empty)
        assert env_flag(FLAG, default=default) is default


def test_any_other_value_raises_naming_the_variable_the_value_and_the_spellings(monkeypatch):
    monkeypatch.setenv(FLAG, "disabled")
    with pytest.raises(ValueError) as raised:
        env_flag(FLAG, default=True)
    assert str(raised.value) == (
        "environment variable DMUON_TEST_FLAG='disabled' is not an on/off value: use one of "
        "1, true, yes, on (on) or 0, false, no, off (off), any case, or unset it for the "
        "default (on)"
    )


def test_a_dmuon_ns_cuda_graph_value_that_is_not_on_or_off_fails_the_construction(monkeypatch):
    monkeypatch.setenv("DMUON_NS_CUDA_GRAPH", "disabled")
    message = r"DMUON_NS_CUDA_GRAPH='disabled' is not an on/off value: use one of 1, true"
    with pytest.raises(ValueError, match=message):
        cuda_graphs_enabled()
    with pytest.raises(ValueError, match=message):
        NewtonSchulz()
