import pytest

from hpc_asyncppo.trainer.credits import CreditController


def test_first_grant_fills_the_budget_evenly_across_ranks():
    c = CreditController(rollout_ranks=3, max_outstanding=10, total_groups=100)
    grants = c.grant()
    assert sum(grants) == 10 and max(grants) - min(grants) <= 1
    assert c.grant() == [0, 0, 0]  # nothing more until a sync frees budget


def test_budget_counts_what_is_produced_since_the_sync_not_what_is_trained():
    c = CreditController(rollout_ranks=1, max_outstanding=5, total_groups=100)
    assert c.grant() == [5]
    for _ in range(5):
        c.received(0)
    c.consumed(trained=4, dropped=0)
    assert c.grant() == [0]  # trained, but no new version yet: still no budget
    c.synced()  # one group still queued -> it counts against the new version's budget
    assert c.used == 1
    assert c.grant() == [4]


def test_sync_mode_budget_is_exactly_one_batch():
    required = 4
    c = CreditController(rollout_ranks=2, max_outstanding=required, total_groups=3 * required)
    for _ in range(3):
        assert sum(c.grant()) == required
        for rank in (0, 0, 1, 1):
            c.received(rank)
        c.consumed(trained=required, dropped=0)
        assert c.outstanding == 0
        c.synced()
    assert c.grant() == [0, 0]  # the run's total has been granted


def test_drops_are_replaced_up_to_the_run_total():
    c = CreditController(rollout_ranks=1, max_outstanding=4, total_groups=4)
    assert c.grant() == [4]
    for _ in range(4):
        c.received(0)
    c.consumed(trained=2, dropped=2)
    c.synced()
    assert c.grant() == [2]


def test_a_group_without_credit_is_a_protocol_error():
    c = CreditController(rollout_ranks=2, max_outstanding=2, total_groups=10)
    with pytest.raises(RuntimeError, match="rollout rank 1 sent a group it had no credit for"):
        c.received(1)


def test_filtered_groups_are_refilled_before_the_next_sync():
    c = CreditController(rollout_ranks=1, max_outstanding=4, total_groups=8)
    assert c.grant() == [4]
    for _ in range(4):
        c.received(0)
    c.consumed(trained=0, dropped=1)  # a stale drop: its budget is spent until the sync
    assert c.grant() == [0]
    c.consumed(trained=0, dropped=2)  # two filtered by dynamic sampling...
    c.refund(2)
    assert c.grant() == [2]  # ...are generated again at once
    for _ in range(2):
        c.received(0)
    c.consumed(trained=3, dropped=0)
    # 5 more groups are due, but the budget is spent until the sync
    assert c.grant() == [0] and c.used == 4
    c.synced()
    assert c.grant() == [4] and c.trained == 3
