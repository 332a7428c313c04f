"""Notes a replica's engine ranks leave its train ranks in their group's store
(megatron_refit.group.store): under ``swap: staged`` whether each prepared a version beside the
live model, read once by train rank 0 after the version landed (``refit/swap_unprepared``)."""

from __future__ import annotations


class _Store:
    """The store calls a replica group's notes use."""

    def __init__(self):
        self.keys = {}

    def set(self, key, value):
        self.keys[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys):
        return all(k in self.keys for k in keys)

    def get(self, key):
        return self.keys[key]

    def delete_key(self, key):
        return self.keys.pop(key, None) is not None


def test_swap_notes_name_the_first_engine_rank_that_loaded_under_the_pause_and_are_removed():
    from megatron_refit.group.store import note_swap, unprepared

    store = _Store()
    note_swap(store, 7, 0, None)
    note_swap(store, 7, 1, "its shadow would take about 3.0 MiB, over the 1.0 MiB refit.swap_budget_mb ...")
    note_swap(store, 8, 0, None)
    assert unprepared(store, 7, ranks=2) == "TP rank 1: its shadow would take about 3.0 MiB, over the 1.0 MiB " \
                                           "refit.swap_budget_mb ..."
    assert unprepared(store, 8, ranks=2) is None  # prepared (rank 1 noted nothing: not counted)
    assert store.keys == {}  # read once
    assert unprepared(None, 9, ranks=1) is None  # a transport without a store


def test_a_store_that_fails_while_reading_the_notes_costs_the_count_not_the_replica(caplog):
    """Train rank 0 reads the notes after the version landed: a store error there is logged and
    the replica keeps its outcome (landed), only its swap is not counted."""
    import logging
    from types import SimpleNamespace

    from megatron_refit.fleet.replica import _unprepared

    class _Broken(_Store):
        def check(self, keys):
            raise RuntimeError("store gone")

    member = SimpleNamespace(group=SimpleNamespace(store=_Broken()), full=SimpleNamespace(num_gen=2))
    with caplog.at_level(logging.WARNING, logger="megatron_refit.fleet.replica"):
        assert _unprepared(member, 1, 7) is None
    assert "refit 7: engine replica 1's swap note could not be read: store gone" in caplog.text
