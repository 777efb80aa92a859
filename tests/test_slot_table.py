"""The disk slot table: asserted slot transitions, and ``check()`` that catches books that
disagree (the table with itself, the policy's pin mirror, the LMDB index)."""

from __future__ import annotations

import pytest
from tierutil import key, open_tier, row_for, store

from tiering.backends.index import pack_record
from tiering.backends.slab_io import aligned_buffer
from tiering.backends.slot_table import SlotState, SlotTable
from tiering.tier import IllegalTransition


def test_slot_transitions_are_asserted():
    t = SlotTable(4)
    s = t.reserve(key(0), 1.0)
    assert t.state_of(key(0)) is SlotState.WRITING and t.writing == 1
    with pytest.raises(IllegalTransition, match=f"slot {s}: WRITING -> READING"):
        t._move(s, SlotState.READING)
    assert t.start_read(key(0)) is None  # not readable while written
    t.published(s, 100, 0, 7)
    with pytest.raises(IllegalTransition, match=f"slot {s}: READY -> READY"):
        t.published(s, 100, 0, 7)  # a second publish of one write
    assert t.start_read(key(0)) == s and t.start_read(key(0)) == s
    assert t.state_of(key(0)) is SlotState.READING and t.pins(key(0)) == 2
    assert t.release(key(0)) is None  # never dropped under a read
    t.end_reads([s, s])
    with pytest.raises(IllegalTransition, match="a read ended that never started"):
        t.end_reads([s])
    assert t.release(key(0)) == s and t.state_of(key(0)) is None
    with pytest.raises(IllegalTransition, match="DROPPING -> WRITING"):
        t._bind(key(1), s, 2.0)  # not reusable until the index forgot the old key
    t.freed([s])
    with pytest.raises(IllegalTransition, match="FREE -> FREE"):
        t.freed([s])
    t.check()


def test_a_failed_write_frees_its_slot_at_once_and_a_reused_slot_skips_dropping():
    t = SlotTable(2)
    a = t.reserve(key("a"), 1.0)
    t.write_failed(key("a"), a)
    assert t.free_count() == 2 and key("a") not in t and t.writing == 0
    b = t.reserve(key("b"), 1.0)
    t.published(b, 10, 0, 1)
    assert t.reuse(key("b"), key("c"), 2.0) == b  # evicted by put for another key
    assert t.state_of(key("c")) is SlotState.WRITING and key("b") not in t
    t.check()


def test_table_check_catches_a_slot_both_free_and_held():
    t = SlotTable(3)
    s = t.reserve(key(0), 1.0)
    t.published(s, 10, 0, 1)
    t.check()
    t.free.append(s)
    with pytest.raises(AssertionError, match="free list"):
        t.check()


def test_file_tier_check_catches_a_policy_pin_the_table_does_not_hold(tmp_path):
    with open_tier(tmp_path, slots=4) as t:
        store(t, [key(0), key(1)])
        t.check(index=True)
        t.policy.pin(key(0))
        with pytest.raises(AssertionError, match="policy pins disagree"):
            t.check()
        t.policy.unpin(key(0))
        out = aligned_buffer(t.row_bytes)
        assert t.get([(key(1), out, None)]) == [True]
        t.check()  # a read in flight: the table's pin and the policy's agree
        t.wait_idle()
        assert bytes(out) == bytes(row_for(key(1)))
        t.check(index=True)


def test_file_tier_check_catches_an_index_record_of_no_key(tmp_path):
    with open_tier(tmp_path, slots=4) as t:
        store(t, [key(0)])
        free = t.slots.free[-1]
        t.index.publish([(key("stray"), pack_record(free, t.row_bytes, 0, 0, 1.0, 1.0, 0))], [])
        t.check()  # the table alone is consistent
        with pytest.raises(AssertionError, match="an index record of no key"):
            t.check(index=True)
        t.index.publish([], [], drop_keys=[key("stray")])
        t.check(index=True)


def test_dropped_slots_are_reused_only_after_the_index_forgot_them(tmp_path):
    with open_tier(tmp_path, slots=2) as t:
        store(t, [key(0), key(1)])
        assert t.drop([key(0)]) == 1
        assert t.slots.free_count() == 0  # DROPPING until the committer deleted the record
        t.check(index=True)
        t.flush()  # the delete is committed, the slot comes back
        assert t.slots.free_count() == 1
        store(t, [key(2)])
        t.check(index=True)


def test_a_failed_batch_that_reused_a_slot_never_leaves_two_records_on_it(tmp_path):
    """put evicts a key and reuses its slot at once; the committer deletes the old record in
    the batch's reserve transaction. If that transaction fails (a full disk), the old record
    is still in the index: the slot must not be handed out again before it is gone, or two
    records claim it (and a restart drops both)."""
    with open_tier(tmp_path, slots=2) as t:
        store(t, [key(0), key(1)])
        real, fails = t.index.reserve, [1]

        def reserve(*a, **kw):
            if fails[0]:
                fails[0] -= 1
                raise OSError(28, "No space left on device")
            return real(*a, **kw)

        t.index.reserve = reserve
        out = t.put([key(2)], [row_for(key(2))])
        assert out.admitted == [key(2)] and len(out.evicted) == 1
        (done,) = t.wait_idle()
        assert not done.ok and done.reason == "full"
        t.flush()  # whatever the owner asked the committer to do since has been done
        t.check(index=True)
        store(t, [key(3)])
        t.check(index=True)
        kept = [k for k in (key(0), key(1), key(3)) if t.contains(k)]
    with open_tier(tmp_path, slots=2) as t:  # the restart keeps every key that was readable
        assert [k for k in kept if t.contains(k)] == kept
        for k in kept:
            out = aligned_buffer(t.row_bytes)
            assert t.get([(k, out, None)]) == [True]
            t.wait_idle()
            assert bytes(out) == bytes(row_for(k))
