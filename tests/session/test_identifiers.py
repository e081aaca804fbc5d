"""The one rule for session ids (``dgr_session.identifiers``): what it admits, what it refuses
and why, and the log escape that keeps a peer's text on one line."""

from __future__ import annotations

import string
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dgr_session import DgrError, FaultKind, fault_kind
from dgr_session.identifiers import (
    SESSION_ID_MAX_LENGTH,
    InvalidIdentifier,
    check_session_id,
    is_valid_session_id,
    log_field,
)

ALPHABET = string.ascii_letters + string.digits + "._:-"


@pytest.mark.parametrize(
    "value",
    [uuid.uuid4().hex, "e2e-0", "a.b_c:d-1", "x", "9" * SESSION_ID_MAX_LENGTH, str(uuid.uuid4())],
)
def test_valid_session_ids_come_back_unchanged(value: str) -> None:
    assert check_session_id(value) is value
    assert is_valid_session_id(value)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("", "empty"),
        ("x" * (SESSION_ID_MAX_LENGTH + 1), "129 characters, at most 128"),
        ("evil\nINFO forged line", "character '\\n'"),
        ("s\u00e9ance", "character '\u00e9'"),
        ("tab\there", "character '\\t'"),
        ("nul\0", "character '\\x00'"),
        ("two words", "character ' '"),
        ("line\u2028sep", "character '\\u2028'"),
        ("slash/id", "character '/'"),
    ],
)
def test_invalid_session_ids_are_refused_naming_why(value: str, why: str) -> None:
    with pytest.raises(InvalidIdentifier) as caught:
        check_session_id(value)
    error = caught.value
    assert error.what == "session id" and why in error.why
    assert str(error) == f"invalid session id: {error.why}"
    assert isinstance(error, ValueError) and isinstance(error, DgrError)
    assert not is_valid_session_id(value)


@pytest.mark.parametrize("value", [None, b"bytes-id", 17, ["s"]])
def test_a_session_id_must_be_a_str(value: object) -> None:
    with pytest.raises(InvalidIdentifier, match="a str is needed, got"):
        check_session_id(value)
    assert not is_valid_session_id(value)


def test_an_invalid_identifier_is_the_clients_fault_never_a_stages() -> None:
    error = InvalidIdentifier("session id", "empty")
    assert error.fault_kind is FaultKind.CLIENT
    assert fault_kind(error) is FaultKind.CLIENT


@given(st.text(min_size=0, max_size=SESSION_ID_MAX_LENGTH + 8))
def test_the_rule_is_length_and_alphabet_exactly(value: str) -> None:
    expected = 1 <= len(value) <= SESSION_ID_MAX_LENGTH and all(c in ALPHABET for c in value)
    assert is_valid_session_id(value) is expected


@given(st.text(alphabet=ALPHABET, min_size=1, max_size=SESSION_ID_MAX_LENGTH))
def test_every_valid_id_is_printable_ascii_as_grpc_metadata_needs(value: str) -> None:
    assert check_session_id(value) == value
    assert all(0x20 < ord(c) < 0x7F for c in value)  # visible ASCII: no space, no control


@pytest.mark.parametrize(
    ("value", "logged"),
    [
        ("plain", "plain"),
        ("evil\nINFO forged", "evil\\nINFO forged"),
        ("cr\r\nlf", "cr\\r\\nlf"),
        ("esc\x1b[31m", "esc\\x1b[31m"),
        ("c1\x85next", "c1\\x85next"),
        ("ls\u2028ps\u2029", "ls\\u2028ps\\u2029"),
        ("s\u00e9ance", "s\u00e9ance"),  # printable non-ASCII stays readable
        (b"raw\n", "b'raw\\n'"),  # not a str: its repr
    ],
)
def test_log_field_keeps_a_value_on_one_line(value: object, logged: str) -> None:
    out = log_field(value)
    assert out == logged
    assert "\n" not in out and "\r" not in out and len(out.splitlines()) == 1


def test_log_field_cuts_long_values_with_an_ellipsis() -> None:
    out = log_field("a" * 500, limit=20)
    assert out == "a" * 19 + "…" and len(out) == 20
    assert log_field("a" * 20, limit=20) == "a" * 20
