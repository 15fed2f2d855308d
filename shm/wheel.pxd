# C declarations of shm/wheel.py for the compiled build (Cython pure Python mode): the
# scalar paths (schedule, cancel, re-arm, advance/expire, release, rearm_fired) in C.
cimport cython
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.long cimport PyLong_FromLongLong
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.string cimport memcpy

from .keyindex cimport KeyIndex
from .placement cimport Placement

cdef long long _MAX_DELAY, _GEN_MASK
cdef Py_ssize_t _DUE_LEVEL
cdef bint _COMPILED


cdef inline void _put_key(unsigned char[::1] b, Py_ssize_t at, bytes ident):
    """Copy ident (33 bytes, checked by the caller) into the record bytes b[at : at + 33]."""
    memcpy(&b[at], <const char *>ident, 33)


cdef inline bytes _key_field(unsigned char[::1] b, Py_ssize_t at):
    """A record's 32-byte key field at b[at] as bytes."""
    return PyBytes_FromStringAndSize(<const char *>&b[at], 32)

cdef inline object _decode_key_at(unsigned char[::1] b, Py_ssize_t at, int meta):
    """keys.decode_key of the key bytes at b[at] (a record's key field, 32 bytes) for a meta
    byte encode_key can write, built straight from the bytes; None for any other meta
    byte (the caller then decodes the Python way, with the same result and errors)."""
    cdef int kind = meta >> 6
    cdef int n = meta & 0x3F
    cdef unsigned long long v = 0
    cdef int k
    if n < 1 or n > 32:
        return None
    if kind == 1:  # str: strict UTF-8, as bytes.decode("utf-8")
        return PyUnicode_DecodeUTF8(<const char *>&b[at], n, NULL)
    if kind == 0:
        return PyBytes_FromStringAndSize(<const char *>&b[at], n)
    if kind == 2 and n == 8:  # int: 8 bytes, little-endian, signed
        for k in range(7, -1, -1):
            v = (v << 8) | b[at + k]
        return PyLong_FromLongLong(<long long>v)
    return None

cdef int _FREE, _SCHEDULED, _FIRED, _STATE_MASK, _LEVEL_SHIFT
cdef Py_ssize_t _CUR, _QW, _IW, _HW, _RB, _PREV, _NEXT, _GEN, _TAG, _AUX, _GROUP, _ST, _KM, _KEY
cdef Py_ssize_t _INTENT_SLOT, _INTENT_STATE, _INTENT_TAG, _INTENT_DEADLINE
cdef Py_ssize_t _C_PENDING, _C_FIRED_UNACKED, _C_ADDS, _C_REARMS, _C_CANCELS, _C_CANCEL_MISSES, _C_EXPIRATIONS
cdef Py_ssize_t _C_CASCADES, _C_ACKS, _C_IDLE_REARMS, _C_ARENA_FULL


@cython.final
cdef class TimerWheel:
    cdef dict __dict__
    cdef public object _seg, records, _hq, _rb, max_groups
    cdef public Py_ssize_t first_entry, n_records, due_list, fired_list, _free_top
    cdef public Placement _placement
    cdef public KeyIndex _index
    cdef public list _heap, _queued
    cdef public long long[::1] _pending_by_level, _group_live
    # the arena's words and bytes, and the free stack, as C arrays
    cdef long long[::1] _clock, _q, _count
    cdef int[::1] _hi, _i, _free_stack
    cdef unsigned int[::1] _hu, _u
    cdef unsigned short[::1] _h
    cdef unsigned char[::1] _b

    @cython.locals(b=cython.Py_ssize_t, expiration=cython.longlong, level=cython.longlong,
                   bp=cython.Py_ssize_t, tail=cython.Py_ssize_t, sp=cython.Py_ssize_t)
    cdef int _link(self, Py_ssize_t slot, long long deadline, long long cur) except -1

    @cython.locals(sp=cython.Py_ssize_t, prev=cython.Py_ssize_t, nxt=cython.Py_ssize_t)
    cdef void _unlink(self, Py_ssize_t slot)

    @cython.locals(cur=cython.longlong, deadline=cython.longlong, g=cython.Py_ssize_t, t=cython.longlong,
                   a=cython.longlong, slot=cython.Py_ssize_t, top=cython.Py_ssize_t,
                   sp=cython.Py_ssize_t, gen=cython.longlong, base=cython.Py_ssize_t, state=cython.int)
    cpdef tuple schedule_ident(self, ident, deadline_ms, group=*, tag=*, aux=*)

    @cython.locals(old_state=cython.int, new_state=cython.int)
    cdef void _rearm(self, Py_ssize_t slot, long long deadline_ms, long long tag, long long cur)

    cdef void _apply_with_intent(self, Py_ssize_t slot, int state, long long deadline_ms, long long tag)

    @cython.locals(slot=cython.Py_ssize_t)
    cpdef bint cancel_ident(self, ident, group=*) except -1

    @cython.locals(state=cython.int)
    cdef void _remove_scheduled(self, Py_ssize_t slot, Py_ssize_t group)

    cdef void _free(self, Py_ssize_t slot)

    @cython.locals(heap=list, queued=list, out=list, i=cython.int[::1], b=cython.Py_ssize_t, bp=cython.Py_ssize_t,
                   s=cython.Py_ssize_t)
    cdef list _collect(self, now_ms)

    @cython.locals(slots=list, now=cython.longlong, q=cython.longlong[::1], b=cython.uchar[::1], by_level=cython.longlong[::1],
                   cur=cython.longlong, fired=cython.Py_ssize_t, cascaded=cython.Py_ssize_t, s=cython.Py_ssize_t,
                   deadline=cython.longlong, state=cython.int, c=cython.longlong[::1])
    cdef Py_ssize_t _sweep(self, now_ms, bint to_fired, list out) except -1

    @cython.locals(base=cython.Py_ssize_t, meta=cython.int)
    cdef int _fire_free(self, Py_ssize_t s, list out) except -1

    @cython.locals(fl=cython.Py_ssize_t, flp=cython.Py_ssize_t, tail=cython.Py_ssize_t)
    cdef void _fire(self, Py_ssize_t s, list out)

    @cython.locals(heap=list, queued=list, i=cython.int[::1], by_level=cython.longlong[::1], ws=Py_ssize_t,
                   due_list=Py_ssize_t, whole=list, mixed=list, chains=list, out=list, b=Py_ssize_t, bp=Py_ssize_t,
                   s=Py_ssize_t, before=Py_ssize_t)
    cpdef tuple _collect_buckets(self, now_ms)

    @cython.locals(i=cython.int[::1], examined=list, s=Py_ssize_t, b=Py_ssize_t, start=Py_ssize_t)
    cpdef cascade_ahead(self, now_ms, max_entries)

    @cython.locals(moved=Py_ssize_t, s=Py_ssize_t, deadline=cython.longlong)
    cdef Py_ssize_t _move_each_to_level0(self, list slots, long long cur) except -1

    @cython.locals(out=list)
    cpdef list advance(self, now_ms)

    @cython.locals(out=list, fired=cython.Py_ssize_t)
    cpdef list expire(self, now_ms)

    @cython.locals(c=cython.longlong[::1])
    cpdef bint release(self, slot, generation) except -1

    @cython.locals(out=list, s=Py_ssize_t, sp=Py_ssize_t, base=Py_ssize_t)
    cpdef list record_rows(self, slots)

    @cython.locals(cur=cython.longlong, deadline=cython.longlong, base=cython.Py_ssize_t, group=cython.Py_ssize_t,
                   state=cython.int, c=cython.longlong[::1])
    cpdef bint rearm_fired(self, slot, generation, deadline_ms) except -1
