"""Python's collector is off while a server starts and on once it has, with what the start
built frozen (out of every later collection); a start that fails leaves it as it was."""

from __future__ import annotations

import gc

import pytest

from handlers.startup_gc import StartupCollection


@pytest.fixture(autouse=True)
def unfrozen():
    yield
    gc.unfreeze()
    gc.enable()


def test_collection_is_off_during_a_start_and_on_with_the_start_frozen_after():
    built = [[] for _ in range(1000)]  # tracked containers, as a start makes
    frozen_before = gc.get_freeze_count()
    with StartupCollection() as startup:
        assert not gc.isenabled()
        startup.loaded()
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen_before + len(built)
    assert gc.isenabled()


def test_a_start_that_never_loads_turns_collection_back_on_without_freezing():
    frozen_before = gc.get_freeze_count()
    with pytest.raises(RuntimeError), StartupCollection():
        assert not gc.isenabled()
        raise RuntimeError("the load failed")
    assert gc.isenabled()
    assert gc.get_freeze_count() == frozen_before


def test_collection_off_before_the_start_stays_off():
    gc.disable()
    with StartupCollection() as startup:
        startup.loaded()
    assert not gc.isenabled()
