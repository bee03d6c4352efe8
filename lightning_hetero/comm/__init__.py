"""What crosses the wire, framework-free: counted collectives, the byte ledger and bandwidth units.

Every byte that crosses a process boundary goes through :mod:`lightning_hetero.comm.collectives` and is counted in a
:class:`ByteLedger` (see ``docs/communication.md`` for the counting rule); :mod:`lightning_hetero.comm.dtypes` moves
the dtypes gloo lacks. Nothing here imports Lightning.
"""

from lightning_hetero.comm.collectives import (
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    irecv,
    isend,
    recv,
    reduce_scatter_tensor,
    send,
)
from lightning_hetero.comm.dump import LEDGER_DIR_ENV, dump_ledger, load_ledger_dumps, register_exit_dump
from lightning_hetero.comm.ledger import (
    COUNTED_OPS,
    INTER,
    INTRA,
    PIPELINE,
    SETUP_STEP,
    STANDARD_LABELS,
    ByteLedger,
    CommRecord,
    LedgerTotals,
    get_ledger,
    validate_label,
    wire_bytes,
)
from lightning_hetero.comm.units import BANDWIDTH_UNITS, format_bytes, parse_bandwidth, transfer_seconds
from lightning_hetero.comm.wrapping import REDUCE_OPS

register_exit_dump()  # no-op unless $LIGHTNING_HETERO_LEDGER_DIR is set (the bandwidth testbed sets it)

__all__ = [
    "BANDWIDTH_UNITS",
    "COUNTED_OPS",
    "INTER",
    "INTRA",
    "LEDGER_DIR_ENV",
    "PIPELINE",
    "REDUCE_OPS",
    "SETUP_STEP",
    "STANDARD_LABELS",
    "ByteLedger",
    "CommRecord",
    "LedgerTotals",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "dump_ledger",
    "format_bytes",
    "get_ledger",
    "irecv",
    "isend",
    "load_ledger_dumps",
    "parse_bandwidth",
    "recv",
    "reduce_scatter_tensor",
    "send",
    "transfer_seconds",
    "validate_label",
    "wire_bytes",
]
