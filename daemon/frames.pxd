# C for daemon/frames.py (Cython pure Python mode): the Expirations frame of a few fired
# records written straight from the arena, in MessagePack, the bytes msgspec writes for the
# same items (tests/test_frames.py holds the two to the same bytes).
cimport cython
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize, PyByteArray_Resize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_SetItem
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

from wheeld.shm.wheel cimport TimerWheel

cdef bint _COMPILED
cdef bytes _VALID_META  # per key meta byte: 1 when some key has it (frames.py sets it)
cdef long long _CAP_MS  # LATENESS_CAP_MS (frames.py sets it)
cdef long long _BOUNDS[18]  # the lateness histogram's bucket bounds (frames.py sets them)

cdef extern from "Python.h":
    long long PyLong_AsLongLongAndOverflow(object, int *) except? -1

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    /* MessagePack's smallest form of an integer, as msgspec writes it: a positive
       fixint, else uint 8/16/32/64 for v >= 0; a negative fixint, else int 8/16/32/64 */
    static inline unsigned char *wheeld_mp_int(unsigned char *o, long long v) {
        uint64_t u;
        if (v >= 0) {
            u = (uint64_t)v;
            if (u < 128) { *o++ = (unsigned char)u; return o; }
            if (u <= 0xFF) { *o++ = 0xcc; *o++ = (unsigned char)u; return o; }
            if (u <= 0xFFFF) { *o++ = 0xcd; *o++ = (unsigned char)(u >> 8); *o++ = (unsigned char)u; return o; }
            if (u <= 0xFFFFFFFFu) {
                *o++ = 0xce;
                *o++ = (unsigned char)(u >> 24); *o++ = (unsigned char)(u >> 16);
                *o++ = (unsigned char)(u >> 8); *o++ = (unsigned char)u;
                return o;
            }
            *o++ = 0xcf;
        } else {
            if (v >= -32) { *o++ = (unsigned char)(int8_t)v; return o; }
            if (v >= -128) { *o++ = 0xd0; *o++ = (unsigned char)(int8_t)v; return o; }
            if (v >= -32768) {
                u = (uint64_t)v;
                *o++ = 0xd1; *o++ = (unsigned char)(u >> 8); *o++ = (unsigned char)u;
                return o;
            }
            u = (uint64_t)v;
            if (v >= -2147483648LL) {
                *o++ = 0xd2;
                *o++ = (unsigned char)(u >> 24); *o++ = (unsigned char)(u >> 16);
                *o++ = (unsigned char)(u >> 8); *o++ = (unsigned char)u;
                return o;
            }
            *o++ = 0xd3;
        }
        u = (uint64_t)v;
        for (int k = 56; k >= 0; k -= 8) *o++ = (unsigned char)(u >> k);
        return o;
    }
    /* an array header of n items */
    static inline unsigned char *wheeld_mp_array(unsigned char *o, uint32_t n) {
        if (n < 16) { *o++ = (unsigned char)(0x90 | n); return o; }
        if (n <= 0xFFFF) { *o++ = 0xdc; *o++ = (unsigned char)(n >> 8); *o++ = (unsigned char)n; return o; }
        *o++ = 0xdd;
        *o++ = (unsigned char)(n >> 24); *o++ = (unsigned char)(n >> 16);
        *o++ = (unsigned char)(n >> 8); *o++ = (unsigned char)n;
        return o;
    }
    static inline void wheeld_frames_prefetch(const void *p) {
        __builtin_prefetch(p);
        __asm__ __volatile__("" : : "r"(p));
    }
    """
    unsigned char *_mp_int "wheeld_mp_int" (unsigned char *o, long long v) nogil
    unsigned char *_mp_array "wheeld_mp_array" (unsigned char *o, unsigned int n) nogil
    void _prefetch "wheeld_frames_prefetch" (const void *p) nogil

# a record's fields (wheeld.protocol.arena_layout; shm/wheel.pxd checks its own copy of
# the layout against it at import, and frames.py checks these)
cdef enum:
    _F_RB = 64  # bytes per record
    _F_DEADLINE = 0  # int64
    _F_GEN = 16  # uint32
    _F_TAG = 20  # uint32
    _F_AUX = 24  # int32
    _F_ST = 30  # state byte
    _F_KM = 31  # key meta byte
    _F_KEY = 32  # the key field, 32 bytes
    _F_KEY_BYTES = 32
    _F_LEN_MASK = 0x3F
    _F_FIRED = 2
    _F_GEN_MAX = 0x7FFFFFFF
    # bytes of one item at most: array header 1, bin 8 of 32 bytes 34, meta 2, deadline and
    # fired_ms 9 each, tag, slot and generation 5 each (all below 2**32), bool 1: 71
    _F_ITEM_MAX = 80
    _F_AHEAD = 4  # records prefetched ahead
    _F_GROUP = 28  # uint16
    _F_BUCKETS = 19  # lateness buckets: the bounds, and one beyond


cdef inline tuple _f_layout():
    """The constants above, in the order frames.py compares them with arena_layout."""
    return (_F_RB, _F_DEADLINE, _F_GEN, _F_TAG, _F_AUX, _F_ST, _F_KM, _F_KEY, _F_KEY_BYTES, _F_LEN_MASK, _F_FIRED, _F_GROUP,
            _F_BUCKETS)


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline object _c_expirations_frame(TimerWheel w, list taken, object aux_object, dict unacked,
                                        bytes key_check, bytes prefix, Py_ssize_t max_body):
    """frames.expirations_frame in C (its docstring says what): two passes over ``taken``.
    The first reads each entry and its record and keeps those still FIRED with their
    generation; any entry or item the C does not take returns None before anything is
    written. The second writes the frame, marks the records and fills ``unacked``."""
    cdef Py_ssize_t n = len(taken), j, k, s, kept = 0, records = w.n_records, first = w.first_entry
    cdef Py_ssize_t length, size
    cdef const unsigned char *check = <const unsigned char *>PyBytes_AS_STRING(key_check)
    cdef unsigned char *b
    cdef unsigned char *r
    cdef unsigned char *o
    cdef unsigned char *start
    cdef long long slot, gen, fired, aux
    cdef int aux32
    cdef unsigned int rgen, tag
    cdef int overflow = 0, c, meta
    cdef long long deadline
    cdef Py_ssize_t *keep
    cdef long long *fired_at
    cdef unsigned char *late_of
    cdef object entry, frame
    cdef tuple t
    if n == 0:
        return None, 0
    if type(aux_object) is not int:
        return None
    aux = PyLong_AsLongLongAndOverflow(aux_object, &overflow)
    if overflow or not -(1 << 31) <= aux < (1 << 31):
        return None
    b = &w._b[0]
    keep = <Py_ssize_t *>malloc(n * (sizeof(Py_ssize_t) + sizeof(long long) + 1))
    if keep == NULL:
        raise MemoryError()
    fired_at = <long long *>(keep + n)
    late_of = <unsigned char *>(fired_at + n)
    try:
        for j in range(n):
            entry = taken[j]
            if type(entry) is not tuple or len(<tuple>entry) != 4:
                return None
            t = <tuple>entry
            if type(t[0]) is not int or type(t[1]) is not int or type(t[2]) is not int:
                return None
            if t[3] is True:
                late_of[j] = 1
            elif t[3] is False:
                late_of[j] = 0
            else:
                return None
            slot = PyLong_AsLongLongAndOverflow(t[0], &overflow)
            if overflow or not first <= slot < records:
                return None
            fired = PyLong_AsLongLongAndOverflow(t[2], &overflow)
            if overflow:
                return None
            gen = PyLong_AsLongLongAndOverflow(t[1], &overflow)
            if j + _F_AHEAD < n:
                entry = taken[j + _F_AHEAD]
                if type(entry) is tuple and len(<tuple>entry) == 4 and type((<tuple>entry)[0]) is int:
                    s = PyLong_AsLongLongAndOverflow((<tuple>entry)[0], &c)
                    if not c and first <= s < records:
                        _prefetch(b + s * _F_RB)
            r = b + slot * _F_RB
            memcpy(&rgen, r + _F_GEN, 4)
            if overflow or r[_F_ST] != _F_FIRED or <long long>rgen != gen:
                continue  # acknowledged (or freed and used again) since it was queued
            meta = r[_F_KM]
            c = check[meta]
            if gen > _F_GEN_MAX or c == 2:
                return None
            if c == 1:
                length = meta & _F_LEN_MASK
                if length > _F_KEY_BYTES:
                    length = _F_KEY_BYTES
                for k in range(length):
                    if r[_F_KEY + k] >= 0x80:
                        return None
            keep[kept] = j
            fired_at[kept] = fired
            late_of[kept] = late_of[j]
            kept += 1
        if kept == 0:
            return None, 0
        size = 4 + PyBytes_GET_SIZE(prefix) + 5 + kept * _F_ITEM_MAX
        if size - 4 > max_body:
            return None
        frame = PyByteArray_FromStringAndSize(NULL, size)
        start = <unsigned char *>PyByteArray_AS_STRING(frame)
        o = start + 4
        memcpy(o, PyBytes_AS_STRING(prefix), PyBytes_GET_SIZE(prefix))
        o += PyBytes_GET_SIZE(prefix)
        o = _mp_array(o, <unsigned int>kept)
        for k in range(kept):
            t = <tuple>taken[keep[k]]
            r = b + (<long long>t[0]) * _F_RB
            meta = r[_F_KM]
            length = meta & _F_LEN_MASK
            if length > _F_KEY_BYTES:
                length = _F_KEY_BYTES
            memcpy(&deadline, r + _F_DEADLINE, 8)
            memcpy(&rgen, r + _F_GEN, 4)
            memcpy(&tag, r + _F_TAG, 4)
            o[0] = 0x98  # the item: an array of 8
            o[1] = 0xc4  # its key: bin 8
            o[2] = <unsigned char>length
            memcpy(o + 3, r + _F_KEY, length)
            o += 3 + length
            o = _mp_int(o, meta)
            o = _mp_int(o, deadline)
            o = _mp_int(o, fired_at[k])
            o = _mp_int(o, tag)
            o = _mp_int(o, <long long>t[0])
            o = _mp_int(o, rgen)
            o[0] = 0xc3 if late_of[k] else 0xc2
            o += 1
        size = o - start
        start[0] = <unsigned char>(size - 4)
        start[1] = <unsigned char>((size - 4) >> 8)
        start[2] = <unsigned char>((size - 4) >> 16)
        start[3] = <unsigned char>((size - 4) >> 24)
        PyByteArray_Resize(frame, size)
        # before the frame leaves: each record names the client it goes to (mark_fired)
        aux32 = <int>aux
        for k in range(kept):
            t = <tuple>taken[keep[k]]
            r = b + (<long long>t[0]) * _F_RB
            memcpy(r + _F_AUX, &aux32, 4)
        for k in range(kept):
            t = <tuple>taken[keep[k]]
            PyDict_SetItem(unacked, t[0], t[1])
        return frame, kept
    finally:
        free(keep)


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline Py_ssize_t _c_queue_usual(TimerWheel w, list slots, Py_ssize_t start, long long now, long long started,
                                      object lateness, object queues) except -1:
    """frames.queue_usual in C (its docstring says what): the lateness of the records queued
    is counted in C and added to ``lateness`` once, as ``Lateness.add`` adds a list."""
    cdef Py_ssize_t end = len(slots), i, k, records = w.n_records, max_groups = w.max_groups
    cdef long long counts[_F_BUCKETS]
    cdef long long sum_ms = 0, beyond = 0, late_ms, tick_us = lateness._tick_us, deadline, slot
    cdef long long floor_ms = now - _CAP_MS
    cdef unsigned char *b = &w._b[0]
    cdef const unsigned char *r
    cdef const unsigned char *valid = <const unsigned char *>PyBytes_AS_STRING(_VALID_META)
    cdef unsigned int gen
    cdef int aux, overflow = 0
    cdef unsigned short group
    cdef Py_ssize_t last_group = -1
    cdef object queue = None, now_object = now, slot_object
    cdef list bucket_counts
    memset(counts, 0, sizeof(counts))
    i = start
    while i < end:
        slot_object = slots[i]
        if type(slot_object) is not int:
            break
        slot = PyLong_AsLongLongAndOverflow(slot_object, &overflow)
        if overflow or not 0 <= slot < records:
            break
        if i + _F_AHEAD < end and type(slots[i + _F_AHEAD]) is int:
            k = PyLong_AsLongLongAndOverflow(slots[i + _F_AHEAD], &overflow)
            if not overflow and 0 <= k < records:
                _prefetch(b + k * _F_RB)
        r = b + slot * _F_RB
        memcpy(&group, r + _F_GROUP, 2)
        memcpy(&aux, r + _F_AUX, 4)
        if group >= max_groups or not valid[r[_F_KM]] or aux >= 0:
            break
        memcpy(&deadline, r + _F_DEADLINE, 8)
        memcpy(&gen, r + _F_GEN, 4)
        # lateness_us without int64 overflow: 0 .. LATENESS_CAP_MS ms, whatever the deadline
        late_ms = 0 if deadline >= now else _CAP_MS if deadline < floor_ms else now - deadline
        sum_ms += late_ms
        if late_ms * 1000 > tick_us:
            beyond += 1
        k = 0  # bisect_left of the bounds
        while k < _F_BUCKETS - 1 and _BOUNDS[k] < late_ms * 1000:
            k += 1
        counts[k] += 1
        if group != last_group:
            queue = queues[group]
            last_group = group
        queue.append((slot_object, gen, now_object, deadline < started))
        i += 1
    if i > start:
        bucket_counts = lateness.counts
        for k in range(_F_BUCKETS):
            if counts[k]:
                bucket_counts[k] += counts[k]
        if beyond:
            lateness.beyond_tick += beyond
        if sum_ms:
            lateness.sum_us += sum_ms * 1000
    return i
