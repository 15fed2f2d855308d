# C types for the compiled client core (Cython pure-Python mode: core.py is the code, this
# file only declares types; see wheeld.protocol.accel).
cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from wheeld.protocol.keycodec cimport _kc_layout, decode_key_c
from wheeld.shm.ring cimport ClientSegment

cdef extern from *:
    """
    #include <time.h>
    /* time.monotonic_ns()'s clock */
    static inline long long wheeld_clock_ns(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    }
    /* a full fence (a locked instruction on x86-64): a later load is not done before an earlier store */
    static inline void wheeld_full_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
    """
    long long _clock_ns "wheeld_clock_ns" () nogil
    void _full_fence "wheeld_full_fence" () nogil

cdef bint _COMPILED
# _set_clock: a simulation's clock replaces CLOCK_MONOTONIC (tested before each clock read)
cdef bint _clock_replaced

cdef long long _now_ns() except? -1


cdef inline object _decode_key_bytes(bytes kb, long long meta):
    """keys.decode_key of an expiration's key by the shared decoder (protocol/keycodec.pxd):
    None when kb is not a key of meta (messages.expiry_keys' check: a valid meta byte and
    its length); a str key not in UTF-8 raises UnicodeDecodeError, as bytes.decode does."""
    return decode_key_c(<const unsigned char *>PyBytes_AS_STRING(kb), PyBytes_GET_SIZE(kb), meta, kb)

cdef Py_ssize_t _KEY_BYTES
cdef long long _SEQ_MASK
cdef Py_ssize_t _SHARD_MASK
cdef long long _STR_META
cdef list _META
cdef Py_ssize_t _CANCEL_MARK_EVERY
cdef long long _CANCEL
cdef long long _ADD_IDLE


cdef class ClientBase:
    pass


cdef class ClientCore(ClientBase):
    cdef public object socket_path
    cdef public object group
    cdef public object ring_timeout_s
    cdef public object reconnect_timeout_s
    cdef public object client_name
    cdef public object _segment
    cdef public object _status
    # the status page (parked epoch, arena counters) and our ring's header words (group_full)
    cdef public object _parked
    cdef public const long long[::1] _page
    cdef public const unsigned long long[::1] _group_words
    cdef public long long _rang_epoch
    cdef public object _welcome
    cdef public long long _seq
    cdef public long long _tag_base
    cdef public list _latest
    cdef public dict _touch_index
    cdef public object _touch_by_key
    cdef public long long[::1] _touch_table
    cdef public object _free_touch
    cdef public object _next_touch
    cdef public list _recent
    cdef public object _recent_order
    cdef public object _ready
    cdef public object _ready_handles
    cdef public object _received
    cdef public list _done
    cdef public object _done_order
    cdef public object _to_ack
    cdef public object _acks_pending
    cdef public list _rearms_pending
    cdef public dict _rearmed
    cdef public object _applied
    cdef public Py_ssize_t _cancels_since_mark
    cdef public object _marks
    cdef public list _cancelled_since_mark
    cdef public object _cancel_log
    cdef public Py_ssize_t _cancel_log_pairs
    cdef public object _cancel_index
    cdef public Py_ssize_t _cancel_indexed
    cdef public Py_ssize_t _cancel_index_idle
    cdef public object _rejected
    cdef public object _flush_answers
    cdef public bint _closed
    cdef public object _owner_pid
    cdef public object _forked
    cdef public object _former_slots
    cdef public object _replay_from
    cdef public object _flush_positions
    cdef public object _answered_at
    cdef public set _answered
    cdef public dict _answer_positions
    cdef public object max_delay_ms
    # _encode's outputs beside the key bytes it returns
    cdef long long _key_meta
    cdef object _key_name
    cdef object __weakref__

    @cython.final
    @cython.locals(text=str, kb=bytes, meta=cython.longlong)
    cdef bytes _encode(self, key)

    @cython.locals(header="const long long[::1]", meta=cython.longlong, seq=cython.longlong, now_ns=cython.longlong,
                   epoch=cython.longlong, shard=dict, seg=ClientSegment, kb=bytes, bkey=object, tag=object)
    cpdef add(self, key, delay_ms)

    @cython.locals(header="const long long[::1]", meta=cython.longlong, seq=cython.longlong, now_ns=cython.longlong,
                   seg=ClientSegment, kb=bytes, bkey=object, tag=object, index=object, now=object,
                   deadline=object, ident=bytes)
    cpdef add_idle(self, key, idle_ms)

    @cython.locals(meta=cython.longlong, seq=cython.longlong, latest=dict, hit=cython.bint, seg=ClientSegment,
                   cancelled=list, kb=bytes, bkey=object, parked="const long long[::1]",
                   epoch=cython.longlong)
    cpdef cancel(self, key)

    @cython.locals(now_ns=cython.longlong, index=Py_ssize_t)
    cpdef touch(self, key)

    @cython.locals(parked="const long long[::1]", epoch=cython.longlong)
    cpdef _after_push(self)
