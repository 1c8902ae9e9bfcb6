"""alignflow/import_gc.py: imports run with the collector off; what they made is frozen after and the
collector is back as it was."""

from __future__ import annotations

import gc

from alignflow.import_gc import imports_without_gc


def test_the_collector_is_off_inside_and_what_was_made_is_frozen_after():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        with imports_without_gc():
            assert not gc.isenabled()
            made = [[index] for index in range(1000)]
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen + len(made)
    finally:
        gc.unfreeze()  # this test process goes on collecting as usual


def test_a_collector_that_was_off_stays_off():
    gc.disable()
    try:
        with imports_without_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()
