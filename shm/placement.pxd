# C declarations of shm/placement.py for the compiled build (Cython pure Python mode).
cimport cython

cdef long long _EXACT_RANGE, _DUE_LEVEL
cdef bint _COMPILED


@cython.final
cdef class Placement:
    cdef public object tick_ms, wheel_size, levels, due_list
    cdef public list ticks, _rules
    cdef public tuple _top
    cdef public bint exact
    cdef long long _ws, _n, _due
    cdef long long[::1] _tk, _up, _reach

    cpdef tuple bucket_for(self, deadline, clock)

    @cython.locals(ws=cython.longlong, level=cython.longlong, t=cython.longlong, v=cython.longlong,
                   tk=cython.longlong[::1], up=cython.longlong[::1], reach=cython.longlong[::1])
    cpdef (long long, long long, long long) place(self, long long deadline, long long clock)
