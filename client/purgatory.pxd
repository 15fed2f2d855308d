# C declarations of client/purgatory.py for the compiled build (Cython pure Python mode:
# purgatory.py is the code, this file declares types; see wheeld.protocol.accel). The
# operation, the purgatory base and the in-process wheel clock are extension types; the
# clocks' threads, the daemon clocks and Purgatory/AsyncPurgatory stay Python classes.
cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.string cimport memset

from wheeld.shm.wheel cimport TimerWheel

cdef extern from *:
    """
    #include <time.h>
    /* time.monotonic_ns()'s clock */
    static inline long long wheeld_purgatory_clock_ns(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    }
    /* one-byte flags changed atomically, with or without the GIL */
    static inline int wheeld_flag_take(char *f) { return __atomic_exchange_n(f, (char)1, __ATOMIC_ACQ_REL) == 0; }
    static inline void wheeld_flag_clear(char *f) { __atomic_store_n(f, (char)0, __ATOMIC_RELEASE); }
    static inline int wheeld_flag_get(char *f) { return __atomic_load_n(f, __ATOMIC_ACQUIRE) != 0; }
    """
    long long _clock_ns "wheeld_purgatory_clock_ns" () nogil
    bint _flag_take "wheeld_flag_take" (char *f) nogil
    void _flag_clear "wheeld_flag_clear" (char *f) nogil
    bint _flag_get "wheeld_flag_get" (char *f) nogil

cdef bint _COMPILED
cdef int _INT_META

cdef class _PurgatoryBase
cdef class _WheelClock


cdef class DelayedOperation:
    cdef public object delay_ms
    cdef public bint expired
    cdef public object error
    cdef object _once, _check_lock  # the Python path's flags
    cdef char _done, _checking, _check_pending  # compiled: the flags, changed atomically
    cdef public _PurgatoryBase _purgatory
    cdef public object _op_id
    cdef public object _handle
    cdef public long long _deadline_ms
    cdef public tuple _watch_keys

    cdef bint _completed(self)
    cdef bint _claim(self)
    cpdef bint force_complete(self) except -1
    @cython.locals(purgatory=_PurgatoryBase)
    cdef int _finish(self) except -1
    @cython.locals(done=bint, retry=bint)
    cdef bint _safe_try_complete(self) except -1
    cdef bint _check_enter(self)
    cdef int _check_exit(self) except -1


cdef inline bint _take_done(DelayedOperation op) noexcept:
    return _flag_take(&op._done)

cdef inline bint _get_done(DelayedOperation op) noexcept:
    return _flag_get(&op._done)

cdef inline bint _take_checking(DelayedOperation op) noexcept:
    return _flag_take(&op._checking)

cdef inline void _clear_checking(DelayedOperation op) noexcept:
    _flag_clear(&op._checking)

cdef inline bint _take_pending(DelayedOperation op) noexcept:
    return _flag_take(&op._check_pending)

cdef inline void _clear_pending(DelayedOperation op) noexcept:
    _flag_clear(&op._check_pending)

cdef inline bint _get_pending(DelayedOperation op) noexcept:
    return _flag_get(&op._check_pending)


cdef inline bytes _int_ident_c(long long op_id):
    """The wheel's record form of int key op_id: meta byte, 8 little-endian bytes, zeros."""
    cdef bytes ident = PyBytes_FromStringAndSize(NULL, 33)
    cdef unsigned char *p = <unsigned char *>PyBytes_AS_STRING(ident)
    cdef int i
    memset(p, 0, 33)
    p[0] = <unsigned char>_INT_META
    for i in range(8):
        p[1 + i] = <unsigned char>((op_id >> (8 * i)) & 0xFF)
    return ident


cpdef long long _ceil_ms() noexcept
cpdef long long _floor_ms() noexcept


cdef class _WheelClock:
    cdef public _PurgatoryBase _p
    cdef public object tick_ms, wheel_size, _backoff
    cdef public TimerWheel wheel
    cdef public list _by_slot
    cdef public long long _wake_at_ms

    @cython.locals(deadline=cython.longlong, ident=bytes, handle=tuple)
    cdef int add(self, DelayedOperation op) except -1

    @cython.locals(handle=tuple)
    cdef int remove(self, DelayedOperation op) except -1

    @cython.locals(wheel=TimerWheel, slots=list, by_slot=list, timed=dict, ops=list, op=DelayedOperation)
    cpdef list _due(self, now_ms)


cdef class _PurgatoryBase:
    cdef public object name, fail_after_s, _lock, _clock, error
    cdef public dict _watchers, _timed
    cdef public long long _id_base, _next_id
    cdef public bint _closed, _owns_client
    cdef public Py_ssize_t expired_total, completed_total, errored_total, foreign_expirations
    cdef public _WheelClock _wheel_clock

    @cython.locals(keys=tuple, lock=object, op_id=object)
    cpdef bint try_complete_else_watch(self, DelayedOperation op, watch_keys) except -1

    @cython.locals(watchers=dict, ops=dict, n=Py_ssize_t, repeated=bint)
    cdef int _watch(self, DelayedOperation op, tuple keys) except -1

    @cython.locals(ops=object, op=DelayedOperation, completed=Py_ssize_t)
    cpdef Py_ssize_t check_and_complete(self, key) except -1

    cdef int _check_usable(self) except -1

    @cython.locals(lock=object, op_id=object)
    cdef int _forget(self, DelayedOperation op) except -1

    @cython.locals(watchers=dict, ops=dict)
    cdef int _unwatch(self, DelayedOperation op) except -1

    @cython.locals(claimed=list, op=DelayedOperation)
    cpdef list _claim_expired(self, list ops)
