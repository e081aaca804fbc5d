"""The worker's kept prompt prefixes (``worker/lifecycle/prefixes.py``): least recently used
first out within the byte capacity, one client's never another's, a prefix too short for the
length asked is a miss."""

from __future__ import annotations

import pytest

from dgr_engine.errors import InvalidArgument
from dgr_engine.wire.frames import prefix_from_proto
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.worker.lifecycle.prefixes import KeptPrefix, PrefixStore

A, B, C = b"a" * 32, b"b" * 32, b"c" * 32


def kept(length: int, size: int) -> KeptPrefix:
    return KeptPrefix(length, bytes(size))


def test_a_kept_prefix_is_taken_by_its_client_up_to_its_length() -> None:
    store = PrefixStore(1000)
    assert store.put("client-1", A, kept(128, 100))
    found = store.take("client-1", A, 64)
    assert found is not None and found.length == 128
    assert store.take("client-1", A, 192) is None  # holds fewer positions than asked
    assert store.take("client-2", A, 64) is None  # another client's: never handed over
    assert store.take("client-1", B, 64) is None
    c = store.counters
    assert (c.kept, c.hits, c.misses, c.positions_reused) == (1, 1, 3, 64)


def test_the_least_recently_used_goes_first_and_bytes_stay_within_the_capacity() -> None:
    store = PrefixStore(250)
    store.put("c", A, kept(64, 100))
    store.put("c", B, kept(64, 100))
    assert store.take("c", A, 64) is not None  # A is now the most recently used
    store.put("c", C, kept(64, 100))  # room for two: B goes
    assert store.take("c", B, 64) is None
    assert store.take("c", A, 64) is not None and store.take("c", C, 64) is not None
    assert store.held_bytes == 200 and len(store) == 2 and store.counters.evicted == 1


def test_a_prefix_larger_than_the_capacity_is_not_kept_and_none_is_kept_at_zero() -> None:
    store = PrefixStore(50)
    assert not store.put("c", A, kept(64, 51))
    assert len(store) == 0 and store.held_bytes == 0
    assert not PrefixStore(0).put("c", A, kept(64, 1))
    with pytest.raises(ValueError):
        PrefixStore(-1)


def test_keeping_a_name_again_replaces_it() -> None:
    store = PrefixStore(1000)
    store.put("c", A, kept(64, 100))
    store.put("c", A, kept(128, 300))
    assert store.held_bytes == 300 and len(store) == 1
    found = store.take("c", A, 128)
    assert found is not None and found.length == 128


def test_a_digest_that_is_no_sha256_is_an_invalid_argument() -> None:
    assert prefix_from_proto(pb.PrefixRef(digest=A, length=64)).length == 64
    for digest in (b"", b"x" * 31, b"x" * 33):
        with pytest.raises(InvalidArgument, match="a prefix digest is 32 bytes"):
            prefix_from_proto(pb.PrefixRef(digest=digest, length=64))
