"""The journal format (protocol/journal.py): round trips of every line type, the
documented line construction, keys as JSON, checksums against every single-byte
change, defect reasons, decoders and the segment scanner fed random bytes,
snapshot files and file names."""

from __future__ import annotations

import random
import zlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from journal_model import (
    T0,
    one_of_each,
)

from wheeld.protocol import journal as pj
from wheeld.protocol.errors import InvalidKey
from wheeld.protocol.journal import (
    Ack,
    Add,
    Cancel,
    Fire,
    IdleRearm,
    Rearm,
    Repl,
    SegmentHeader,
    SnapshotHeader,
    SnapshotPending,
    SnapshotUnacked,
    key_from_json,
    key_to_json,
)


def test_every_event_type_round_trips():
    header = SegmentHeader(host="h", name="default", lsn=1, t=T0, mono0=5, wall0=T0)
    events = one_of_each()
    for n, event in enumerate(events, 1):
        event.n = n
    kinds = {type(event) for event in events}
    assert kinds == {Add, Rearm, Cancel, Fire, Ack, IdleRearm}
    for event in [header, *events]:
        line = pj.encode_event(event)
        assert line.endswith(b"}\n") and line.count(b"\n") == 1
        assert pj.check_line(line) and pj.check_line(line.decode())
        assert pj.decode_line(line) == event
        raw = msgspec.json.decode(line)
        assert raw["v"] == pj.JOURNAL_VERSION and raw["crc"] == zlib.crc32(msgspec.json.encode(event))
        assert list(raw)[-1] == "crc"
    data = pj.encode_events([header, *events])
    decoded, good_end, defect = pj.scan_segment(data)
    assert defect is None and good_end == len(data)
    assert decoded == [header, *events]


def _repl(n: int = 0, **fields) -> Repl:
    values = dict(t=T0 + 60_010, host="web-3", epoch=3, state="replicating", rlsn=1005, lag=1, lag_ms=4)
    values.update(fields)
    return Repl(n=n, **values)


def test_the_repl_event_round_trips_with_its_crc_and_its_documented_form():
    """A replication sample: encoded as the documented line (fields in the documented order,
    crc last), decoded back by every reader of the format, read in a segment between timer
    events (its lsn in the sequence), and every flipped byte of it caught by its crc."""
    event = _repl(n=1007)
    line = pj.encode_event(event)
    assert list(msgspec.json.decode(line)) == ["ev", "v", "n", "t", "host", "epoch", "state", "rlsn", "lag",
                                               "lag_ms", "crc"]
    assert line.decode() in pj.__doc__.replace("\n    ", "\n")  # the docstring's example is the real line
    body = msgspec.json.encode(event)
    assert line == body[:-1] + b',"crc":' + str(zlib.crc32(body)).encode() + b"}\n"
    assert pj.check_line(line) and pj.check_line(line.decode()) and pj.decode_line(line) == event
    assert pj.EVENT_TYPES["repl"] is Repl and set(pj.REPL_STATES) >= {"replicating", "behind", "fenced"}
    for position in range(len(line) - 1):
        for mask in (0x01, 0x40):
            corrupted = bytearray(line)
            corrupted[position] ^= mask
            assert not pj.check_line(bytes(corrupted)), (position, mask)
    header = SegmentHeader(host="h", name="n", lsn=1, t=T0, mono0=0, wall0=T0)
    events = one_of_each()[:3]
    events.insert(1, _repl(state="behind", lag=2, lag_ms=10_000))
    events.append(_repl(state="fenced"))
    for n, item in enumerate(events, 1):
        item.n = n
    data = pj.encode_events([header, *events])
    for scanned in (pj.scan_segment(data)[0], [header, *pj.scan_lines(data).events]):
        assert scanned == [header, *events]
    # a field missing, or of the wrong type: not a version-1 event (reported, never guessed)
    for bad in (b'{"ev":"repl","v":1,"n":1,"t":1,"host":"h","epoch":1,"state":"behind"}',
                b'{"ev":"repl","v":1,"n":1,"t":1,"host":"h","epoch":1,"state":2,"rlsn":0,"lag":0,"lag_ms":0}'):
        with pytest.raises(pj.CorruptJournal):
            pj.decode_line(pj.encode_line(bad))


def test_line_is_the_documented_construction():
    event = Add(n=3, t=T0, g="g", k="k", d=T0 + 5, s=1)
    body = msgspec.json.encode(event)
    assert pj.encode_event(event) == body[:-1] + b',"crc":' + str(zlib.crc32(body)).encode() + b"}\n"
    assert pj.line_body(pj.encode_event(event)) == body
    # optional fields are absent, not null
    assert b'"i"' not in body and b"null" not in body


@given(st.one_of(st.text(min_size=1), st.binary(min_size=1), st.integers(-(2**63), 2**63 - 1)))
def test_key_json_round_trip(key):
    value = key_to_json(key)
    assert type(value) in (str, int)
    back = key_from_json(value)
    assert back == key and type(back) is type(key)
    # the JSON form survives a journal line
    line = pj.encode_event(Add(n=1, t=0, g="g", k=value, d=0, s=0))
    assert key_from_json(pj.decode_line(line).k) == key


def test_key_json_keeps_types_apart():
    forms = {key_to_json("b64:AA=="), key_to_json(b"\x00"), key_to_json("str:x"), key_to_json("17"), key_to_json(17)}
    assert len(forms) == 5
    with pytest.raises(InvalidKey):
        key_to_json(True)
    with pytest.raises(InvalidKey):
        key_to_json(1.5)
    with pytest.raises(pj.CorruptJournal):
        key_from_json("b64:!!!")


def _segment_bytes(count: int = 6) -> tuple[bytes, list[bytes]]:
    header = SegmentHeader(host="h", name="n", lsn=1, t=T0, mono0=0, wall0=T0)
    events = one_of_each()[:count]
    for n, event in enumerate(events, 1):
        event.n = n
    lines = [pj.encode_event(line) for line in [header, *events]]
    return b"".join(lines), lines


def test_crc_detects_every_flipped_byte():
    data, lines = _segment_bytes()
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    rng = random.Random(7)
    for position in range(len(data)):
        for mask in (0x01, 0x80, rng.randrange(1, 256)):
            corrupted = bytearray(data)
            corrupted[position] ^= mask
            events, good_end, defect = pj.scan_segment(bytes(corrupted))
            line_index = max(i for i, start in enumerate(starts[:-1]) if start <= position)
            assert defect is not None, (position, mask)
            # everything before the damaged line is kept, nothing from it on
            assert good_end == starts[line_index]
            assert len(events) == line_index
            assert defect.offset == starts[line_index] and defect.line_no == line_index + 1


def test_defect_reasons():
    data, lines = _segment_bytes()
    # torn: no newline at the end
    _, good_end, defect = pj.scan_segment(data[:-5])
    assert defect.reason == pj.TORN and good_end == len(data) - len(lines[-1])
    # torn: zeros after the last good line (file grew, data never written)
    _, good_end, defect = pj.scan_segment(data + b"\x00" * 4096)
    assert defect.reason == pj.TORN and good_end == len(data)
    # checksum mismatch in the middle, with lines after it
    corrupted = data.replace(b'"g":"jobs"', b'"g":"jabs"', 1)
    _, _, defect = pj.scan_segment(corrupted)
    assert defect.reason == pj.CHECKSUM and defect.lines_after > 0
    # a line with a good crc that is not a version-1 event
    future = pj.encode_line(b'{"ev":"add","v":2,"n":7,"t":0,"g":"g","k":"k","d":0,"s":0}')
    events, good_end, defect = pj.scan_segment(data + future)
    assert defect.reason == pj.BAD_VERSION and good_end == len(data) and len(events) == len(lines)
    unknown = pj.encode_line(b'{"ev":"teleport","v":1,"n":7}')
    _, _, defect = pj.scan_segment(data + unknown)
    assert defect.reason == pj.BAD_JSON
    # a gap in lsns
    gap = pj.encode_event(Add(n=99, t=0, g="g", k="k", d=0, s=0))
    _, good_end, defect = pj.scan_segment(data + gap)
    assert defect.reason == pj.LSN_GAP and good_end == len(data)
    # no header
    _, good_end, defect = pj.scan_segment(b"".join(lines[1:]))
    assert defect.reason == pj.BAD_HEADER and good_end == 0
    assert "bad-header at byte 0" in str(defect)


@given(st.binary(max_size=400))
@settings(max_examples=300)
def test_scan_random_bytes_never_raises(data):
    events, good_end, defect = pj.scan_segment(data)
    assert 0 <= good_end <= len(data)
    assert defect is not None or good_end == len(data)
    with pytest.raises(pj.CorruptJournal):
        pj.parse_snapshot(data)


@given(st.binary(max_size=200))
def test_decode_line_random_bytes_raises_protocol_error(data):
    try:
        event = pj.decode_line(data)
    except pj.CorruptJournal:
        return
    assert isinstance(event, tuple(pj.EVENT_TYPES.values()))


def test_snapshot_bytes_round_trip_and_checks():
    header = SnapshotHeader(lsn=9, count=0, unacked=0, t=T0, host="h", name="n")
    pending = [SnapshotPending(g="g", k=key_to_json(i), d=T0 + i, s=i) for i in range(5)]
    pending.append(SnapshotPending(g="idle", k="c", d=T0, s=1, i=30_000))
    unacked = [SnapshotUnacked(g="g", k="z", d=T0, s=3, f=T0 + 2, lat=2)]
    data = pj.encode_snapshot(header, pending, unacked)
    parsed_header, parsed_pending, parsed_unacked = pj.parse_snapshot(data)
    assert (parsed_header.lsn, parsed_header.count, parsed_header.unacked) == (9, 6, 1)
    assert parsed_pending == pending and parsed_unacked == unacked
    for position in range(0, len(data), 7):
        corrupted = bytearray(data)
        corrupted[position] ^= 0x20
        with pytest.raises(pj.CorruptJournal):
            pj.parse_snapshot(bytes(corrupted))
    with pytest.raises(pj.CorruptJournal):
        pj.parse_snapshot(data[:-1])


def test_file_names():
    assert pj.segment_name(42) == "journal-0000000000000042.jsonl"
    assert pj.parse_segment_name(pj.segment_name(42)) == 42
    assert pj.parse_snapshot_name(pj.snapshot_name(7)) == 7
    assert pj.parse_segment_name("journal-42.jsonl") is None
    assert pj.parse_segment_name("journal-0000000000000042.jsonl.cut-5") is None


def test_scan_with_skip_matches_full_scan():
    data, lines = _segment_bytes(count=11)
    full, full_end, full_defect = pj.scan_segment(data)
    assert full_defect is None
    for skip in range(0, 12):
        events, good_end, defect = pj.scan_segment(data, skip_events=skip)
        assert defect is None and good_end == len(data)
        assert events == [full[0]] + full[1 + skip :]
    # a defect after the skipped part is reported at its real place
    torn = data[:-7]
    events, good_end, defect = pj.scan_segment(torn, skip_events=4)
    assert defect.reason == pj.TORN and defect.offset == len(data) - len(lines[-1])
    assert defect.line_no == len(lines) and events == [full[0]] + full[5:-1]
    # a defect inside the skipped part goes unseen: those events are not read at all
    broken = bytearray(data)
    broken[len(lines[0]) + 20] ^= 0x01
    events, _, defect = pj.scan_segment(bytes(broken), skip_events=3)
    assert defect is None and events[1:] == full[4:]
