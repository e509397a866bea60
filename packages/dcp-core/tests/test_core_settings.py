"""The settings module: defaults, validation that names the variable, read when used."""

from __future__ import annotations

import pytest

from hyper_parallel_dcp.core import settings
from hyper_parallel_dcp.core.collectives import collective_timeout
from hyper_parallel_dcp.core.settings import SettingError


def test_unset_or_blank_means_the_default(monkeypatch):
    for s in settings.SETTINGS:
        monkeypatch.delenv(s.name, raising=False)
        assert s.get() == s.default, s.name
        monkeypatch.setenv(s.name, "   ")
        assert s.get() == s.default, s.name
    assert settings.COLLECTIVE_TIMEOUT.default == settings.ASYNC_TIMEOUT.default == 1800.0
    assert (settings.FILES_KEPT.default, settings.READ_AHEAD.default, settings.BROADCASTS_IN_FLIGHT.default) == (8, 2, 8)
    assert settings.ALIGNED_WRITES.default is None  # auto: decided by the machine (storage_fs.host_memory)
    monkeypatch.setenv("HP_DCP_ALIGNED_WRITES", "AUTO")
    assert settings.ALIGNED_WRITES.get() is None


@pytest.mark.parametrize("setting,raw,value,later", [
    (settings.COLLECTIVE_TIMEOUT, "12.5", 12.5, "13"),
    (settings.COLLECTIVE_TIMEOUT, "0", 0.0, "1"),
    (settings.ASYNC_TIMEOUT, " 90 ", 90.0, "91"),
    (settings.ASYNC_GLOO_PORT, "29501", 29501, "29502"),
    (settings.FILES_KEPT, "32", 32, "33"),
    (settings.READ_AHEAD, "1", 1, "3"),
    (settings.BROADCASTS_IN_FLIGHT, "4", 4, "5"),
    (settings.MAILBOX_POLL_MAX, "0.01", 0.01, "0.02"),
    (settings.ASYNC_SHUTDOWN_TIMEOUT, "5", 5.0, "6"),
    (settings.LOG_CONFIG, "DCP:INFO", "DCP:INFO", "DCP:DEBUG"),
    (settings.ALIGNED_WRITES, "1", True, "auto"),
    (settings.ALIGNED_WRITES, "Off", False, "on"),
])
def test_a_value_is_read_when_used(monkeypatch, setting, raw, value, later):
    monkeypatch.setenv(setting.name, raw)
    assert setting.get() == value
    monkeypatch.setenv(setting.name, later)
    assert setting.get() == setting.parse(setting.name, later) != value  # nothing frozen at first use


@pytest.mark.parametrize("setting,raw,why", [
    (settings.COLLECTIVE_TIMEOUT, "abc", "not a number of seconds"),
    (settings.COLLECTIVE_TIMEOUT, "-1", ">= 0"),
    (settings.ASYNC_TIMEOUT, "nan", ">= 0"),
    (settings.ASYNC_TIMEOUT, "30m", "not a number of seconds"),
    (settings.ASYNC_GLOO_PORT, "70000", "between 1 and 65535"),
    (settings.ASYNC_GLOO_PORT, "http", "not a port number"),
    (settings.FILES_KEPT, "0", "at least 1"),
    (settings.READ_AHEAD, "2.5", "not a whole number"),
    (settings.BROADCASTS_IN_FLIGHT, "-3", "at least 1"),
    (settings.MAILBOX_POLL_MAX, "fast", "not a number of seconds"),
    (settings.ALIGNED_WRITES, "maybe", "use 1, 0 or auto"),
])
def test_a_bad_value_names_the_variable_and_the_value(monkeypatch, setting, raw, why):
    monkeypatch.setenv(setting.name, raw)
    with pytest.raises(SettingError, match=f"^{setting.name}={raw!r}.*{why}"):
        setting.get()
    assert issubclass(SettingError, ValueError)  # callers catching ValueError keep working


def test_the_collective_wrapper_reads_the_setting(monkeypatch):
    monkeypatch.setenv("HP_DCP_COLLECTIVE_TIMEOUT", "7")
    assert collective_timeout() == 7.0
    monkeypatch.setenv("HP_DCP_COLLECTIVE_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="HP_DCP_COLLECTIVE_TIMEOUT='soon'"):
        collective_timeout()


def test_every_setting_is_named_once_and_documented():
    names = [s.name for s in settings.SETTINGS]
    assert len(names) == len(set(names))
    assert all(n.startswith("HP_DCP_") or n == "HP_LOG_CONFIG" for n in names)
    assert all(len(s.doc) > 20 for s in settings.SETTINGS)
