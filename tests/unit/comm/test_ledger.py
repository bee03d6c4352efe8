"""ByteLedger bookkeeping and the pure byte-counting rule (no processes)."""

from __future__ import annotations

import pytest

from lightning_hetero.comm import (
    INTER,
    INTRA,
    PIPELINE,
    SETUP_STEP,
    ByteLedger,
    CommRecord,
    LedgerTotals,
    get_ledger,
    wire_bytes,
)


def _record(ledger: ByteLedger, label: str, sent: int, received: int, op: str = "all_gather") -> CommRecord:
    return ledger.record(op, label, payload_bytes=sent, sent=sent, received=received, group_size=4)


def test_totals_per_label_and_overall() -> None:
    ledger = ByteLedger()
    _record(ledger, INTER, 100, 40)
    _record(ledger, INTER, 5, 7)
    _record(ledger, INTRA, 1000, 2000)
    assert ledger.totals(INTER) == LedgerTotals(sent=105, received=47, calls=2)
    assert ledger.totals(INTRA) == LedgerTotals(sent=1000, received=2000, calls=1)
    assert ledger.totals(PIPELINE) == LedgerTotals()
    assert ledger.totals() == LedgerTotals(sent=1105, received=2047, calls=3)
    assert ledger.labels() == [INTER, INTRA]


def test_records_carry_every_field_and_the_step() -> None:
    ledger = ByteLedger()
    ledger.set_step(7)
    record = ledger.record("broadcast", "custom-link", payload_bytes=10, sent=30, received=0, group_size=4)
    assert record == CommRecord(
        op="broadcast", label="custom-link", group_size=4, payload_bytes=10, sent=30, received=0, step=7
    )
    assert ledger.records() == [record]


def test_step_totals_group_by_step() -> None:
    ledger = ByteLedger()
    ledger.step = 0
    _record(ledger, INTER, 1, 2)
    ledger.set_step(1)
    _record(ledger, INTER, 10, 20)
    _record(ledger, INTER, 100, 200)
    _record(ledger, INTRA, 3, 3)
    assert ledger.step == 1
    assert ledger.step_totals(0) == {INTER: LedgerTotals(1, 2, 1)}
    assert ledger.step_totals() == {INTER: LedgerTotals(110, 220, 2), INTRA: LedgerTotals(3, 3, 1)}
    assert ledger.step_totals(99) == {}
    assert ledger.steps() == [0, 1]


def test_memory_is_bounded() -> None:
    ledger = ByteLedger(max_records=2, max_steps_kept=3)
    for step in range(5):
        ledger.set_step(step)
        _record(ledger, INTER, step + 1, 0)
    assert ledger.steps() == [2, 3, 4]
    assert ledger.step_totals(1) == {}
    assert [r.step for r in ledger.records()] == [3, 4]
    assert ledger.totals(INTER) == LedgerTotals(sent=15, received=0, calls=5)  # cumulative totals are never dropped


def test_zero_records_kept() -> None:
    ledger = ByteLedger(max_records=0)
    _record(ledger, INTER, 1, 1)
    assert ledger.records() == []
    assert ledger.totals(INTER).calls == 1


def test_reset_keeps_the_step() -> None:
    ledger = ByteLedger()
    ledger.set_step(4)
    _record(ledger, INTER, 1, 1)
    ledger.reset()
    assert ledger.totals() == LedgerTotals()
    assert ledger.labels() == [] and ledger.records() == [] and ledger.steps() == []
    assert ledger.step == 4


def test_state_dict_round_trip() -> None:
    ledger = ByteLedger()
    ledger.set_step(3)
    _record(ledger, INTER, 11, 12)
    _record(ledger, INTRA, 13, 14)
    state = ledger.state_dict()
    assert state == {
        "version": 1,
        "step": 3,
        "totals": {INTER: {"sent": 11, "received": 12, "calls": 1}, INTRA: {"sent": 13, "received": 14, "calls": 1}},
    }
    restored = ByteLedger()
    _record(restored, PIPELINE, 1, 1)  # replaced, not merged
    restored.load_state_dict(state)
    assert restored.labels() == [INTER, INTRA]
    assert restored.totals(INTER) == LedgerTotals(11, 12, 1)
    assert restored.step == 3
    assert restored.records() == []
    _record(restored, INTER, 1, 1)
    assert restored.totals(INTER) == LedgerTotals(12, 13, 2)
    with pytest.raises(ValueError, match="version"):
        restored.load_state_dict({"version": 99, "totals": {}})


def test_capture_sees_only_the_block() -> None:
    ledger = ByteLedger()
    _record(ledger, INTER, 1, 1)
    ledger.set_step(5)
    with ledger.capture() as outer:
        _record(ledger, INTER, 10, 10)
        with ledger.capture() as inner:
            ledger.set_step(6)
            _record(ledger, INTRA, 100, 100)
        _record(ledger, INTER, 1000, 1000)
    _record(ledger, INTER, 10000, 10000)
    assert outer.totals() == LedgerTotals(1110, 1110, 3)
    assert inner.totals() == LedgerTotals(100, 100, 1)
    assert outer.step_totals(5) == {INTER: LedgerTotals(10, 10, 1)}
    assert outer.step_totals(6) == {INTRA: LedgerTotals(100, 100, 1), INTER: LedgerTotals(1000, 1000, 1)}
    assert inner.step == 6
    assert ledger.totals() == LedgerTotals(11111, 11111, 5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"label": ""}, "label must be a non-empty string"),
        ({"label": None}, "label must be a non-empty string"),
        ({"sent": -1}, "must be >= 0"),
        ({"payload_bytes": -1}, "must be >= 0"),
        ({"group_size": 0}, "group_size"),
    ],
)
def test_record_rejects_bad_input(kwargs: dict, match: str) -> None:
    arguments = {"op": "send", "label": INTER, "payload_bytes": 1, "sent": 1, "received": 0, "group_size": 2}
    with pytest.raises(ValueError, match=match):
        ByteLedger().record(**{**arguments, **kwargs})


def test_global_ledger_is_one_object() -> None:
    assert get_ledger() is get_ledger()
    assert isinstance(get_ledger(), ByteLedger)


# ------------------------------------------------------------------------------------------ the counting rule
MIB = 1024 * 1024


@pytest.mark.parametrize(
    ("op", "payload", "n", "extra", "expected"),
    [
        # the worked example of docs/communication.md: a 1 MiB float32 tensor on n = 2 and n = 4
        ("all_reduce", MIB, 2, {}, (1_048_576, 1_048_576)),
        ("all_reduce", MIB, 4, {}, (1_572_864, 1_572_864)),
        ("all_gather", MIB, 2, {}, (1_048_576, 1_048_576)),
        ("all_gather", MIB, 4, {}, (3_145_728, 3_145_728)),
        ("reduce_scatter_tensor", MIB, 2, {}, (524_288, 524_288)),
        ("reduce_scatter_tensor", MIB, 4, {}, (786_432, 786_432)),
        ("broadcast", MIB, 2, {"rank": 0, "src": 0}, (1_048_576, 0)),
        ("broadcast", MIB, 4, {"rank": 0, "src": 0}, (3_145_728, 0)),
        ("broadcast", MIB, 4, {"rank": 1, "src": 0}, (0, 1_048_576)),
        ("send", MIB, 4, {}, (1_048_576, 0)),
        ("recv", MIB, 4, {}, (0, 1_048_576)),
        ("all_to_all_single", MIB, 2, {}, (524_288, 524_288)),
        ("all_to_all_single", MIB, 4, {}, (786_432, 786_432)),
        # all_reduce: floor(2(n-1)S/n) both ways
        ("all_reduce", 4 * MIB, 2, {}, (4 * MIB, 4 * MIB)),
        ("all_reduce", 4 * MIB, 4, {}, (6 * MIB, 6 * MIB)),
        ("all_reduce", 3, 4, {}, (4, 4)),  # 18 / 4 = 4.5 -> 4
        ("all_reduce", 10, 3, {}, (13, 13)),  # 40 / 3 = 13.3 -> 13
        ("all_reduce", 3, 2, {}, (3, 3)),
        # all_gather: (n-1) S_local both ways
        ("all_gather", 12, 4, {}, (36, 36)),
        ("all_gather_into_tensor", 7, 2, {}, (7, 7)),
        # reduce_scatter: floor((n-1)S/n), S = full input
        ("reduce_scatter_tensor", 48, 4, {}, (36, 36)),
        ("reduce_scatter_tensor", 10, 3, {}, (6, 6)),  # 20 / 3 -> 6
        # broadcast: root sends (n-1)S, everyone else receives S
        ("broadcast", 10, 4, {"rank": 2, "src": 2}, (30, 0)),
        ("broadcast", 10, 4, {"rank": 0, "src": 2}, (0, 10)),
        # point to point
        ("send", 10, 4, {}, (10, 0)),
        ("isend", 10, 2, {}, (10, 0)),
        ("recv", 10, 4, {}, (0, 10)),
        ("irecv", 10, 2, {}, (0, 10)),
        # all_to_all: everything except the block a rank keeps for itself
        ("all_to_all_single", 48, 4, {}, (36, 36)),
        ("all_to_all_single", 40, 4, {"output_bytes": 24, "own_block_bytes": 8}, (32, 16)),
    ],
)
def test_wire_bytes_formulas(op: str, payload: int, n: int, extra: dict, expected: tuple[int, int]) -> None:
    assert wire_bytes(op, payload, n, **extra) == expected


@pytest.mark.parametrize(
    "op",
    ["all_reduce", "all_gather", "reduce_scatter_tensor", "broadcast", "send", "recv", "all_to_all_single"],
)
def test_wire_bytes_group_of_one_is_free(op: str) -> None:
    assert wire_bytes(op, 1000, 1) == (0, 0)
    assert wire_bytes(op, 1000, 1, rank=0, src=0) == (0, 0)


def test_wire_bytes_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="Unknown collective 'gossip'"):
        wire_bytes("gossip", 1, 2)
    with pytest.raises(ValueError, match="payload_bytes >= 0"):
        wire_bytes("all_reduce", -1, 2)
    with pytest.raises(ValueError, match="group_size >= 1"):
        wire_bytes("all_reduce", 1, 0)


def test_traffic_before_the_first_step_boundary_is_setup() -> None:
    ledger = ByteLedger()
    assert ledger.step == SETUP_STEP == -1
    _record(ledger, INTER, 500, 500)  # e.g. the initial model broadcast of a strategy's setup
    ledger.set_step(0)
    _record(ledger, INTER, 7, 7)
    assert ledger.step_totals(SETUP_STEP) == {INTER: LedgerTotals(500, 500, 1)}
    assert ledger.step_totals(0) == {INTER: LedgerTotals(7, 7, 1)}  # step 0 holds only its own traffic
    assert ledger.steps() == [SETUP_STEP, 0]
    assert [record.step for record in ledger.records()] == [SETUP_STEP, 0]
