"""dgr's one status table (``dgr_engine.status``) against the C header and the error classes:
every C status is in the table with its code and name, every status a worker sends has a C code
(so a native link carries it as a number), and every class agrees with its row."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest

from dgr_engine import errors as E
from dgr_engine._binding import lib, status_name
from dgr_engine.status import STATUSES, Status, error_for, error_for_code, status_of
from dgr_engine.wire.status import error_from_rpc, grpc_status_for, known_statuses

HEADER = Path(__file__).resolve().parents[2] / "native" / "include" / "dgr_shard.h"


def _c_statuses() -> dict[str, int]:
    text = HEADER.read_text()
    body = text[text.index("typedef enum dgr_status {") : text.index("} dgr_status;")]
    return {m[0]: int(m[1]) for m in re.findall(r"\b(DGR_E_[A-Z_]+) = (\d+),", body)}


def test_the_table_is_the_c_header() -> None:
    c = _c_statuses()
    table = {str(s): r.c_code for s, r in STATUSES.items() if r.c_code is not None}
    assert table == c
    for name, code in c.items():
        assert status_name(code) == name  # the library's names are the header's
        assert int(getattr(lib, name)) == code


def test_every_status_has_one_row_and_every_worker_status_a_c_code() -> None:
    assert set(STATUSES) == set(Status)
    for status in known_statuses():
        assert STATUSES[Status(status)].c_code is not None, status  # a native link can say it


@pytest.mark.parametrize("status", list(Status))
def test_each_status_raises_its_class_and_round_trips(status: Status) -> None:
    rule = STATUSES[status]
    error = error_for(status, "why")
    assert type(error) is rule.error and error.status == status
    assert error.fault_kind is rule.fault_kind
    if rule.c_code is not None:
        by_code = error_for_code(rule.c_code, "why")
        assert type(by_code) is rule.error and by_code.status == status
        assert str(by_code) == f"{status}: why"
    if rule.grpc_code is not None:
        assert status_of(error) is status
        code, name = grpc_status_for(error)
        assert (code.name, name) == (rule.grpc_code, status)
        assert type(error_from_rpc(code, name, "why")) is rule.error
    else:
        assert status_of(error) is Status.INTERNAL  # never sent: a worker's bug if raised


def test_every_error_class_names_a_status_of_the_table() -> None:
    classes = [getattr(E, name) for name in E.__all__]
    for cls in classes:
        bases = (E.ShardError, E.EngineError, E.ShardTransportError)
        if isinstance(cls, type) and issubclass(cls, E.ShardError) and cls not in bases:
            status = Status(cls.status)
            row = STATUSES[status]
            assert issubclass(row.error, cls) or issubclass(cls, row.error), cls
            code = getattr(cls, "code", -1)
            assert code in (-1, row.c_code), cls


def test_an_unknown_code_is_typed_not_lost() -> None:
    error = error_for_code(999, "odd")
    assert type(error) is E.EngineError and error.status == Status.UNKNOWN_STATUS
    assert error.code == 999


def test_no_status_is_read_from_text() -> None:
    """A status travels as a number (C, native links) or a trailer (gRPC): no module matches
    a status name at the start of a message."""
    root = Path(__file__).resolve().parents[2] / "dgr_engine"
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert "DGR_E_[A-Z" not in text, path
        assert not re.search(r"startswith\(\s*[\"']DGR_E_", text), path


def test_grpc_codes_resolve() -> None:
    for rule in STATUSES.values():
        if rule.grpc_code is not None:
            assert isinstance(grpc.StatusCode[rule.grpc_code], grpc.StatusCode)
