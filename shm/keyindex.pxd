# C declarations of shm/keyindex.py for the compiled build (Cython pure Python mode).
cimport cython
from libc.string cimport memcmp

# hash() of a bytes object from its bytes, without making the object (the batch paths of
# wheel.pxd and daemon/executor.pxd hash keys this way): CPython's _Py_HashBytes, which
# Python.h stopped declaring in 3.13 (it moved to the internal pycore_pyhash.h, still
# exported) and which 3.14 offers as Py_HashBuffer. Called undeclared, C would take its
# result for an int and keep 32 of its 64 bits: the prototype is given here.
cdef extern from *:
    """
    #ifndef WHEELD_HASH_BYTES
    #define WHEELD_HASH_BYTES
    #if PY_VERSION_HEX >= 0x030E0000
    #define wheeld_hash_bytes(p, n) Py_HashBuffer((p), (n))
    #else
    #if PY_VERSION_HEX >= 0x030D0000
    PyAPI_FUNC(Py_hash_t) _Py_HashBytes(const void *, Py_ssize_t);
    #endif
    #define wheeld_hash_bytes(p, n) _Py_HashBytes((p), (n))
    #endif
    #endif
    """
    Py_hash_t _hash_bytes "wheeld_hash_bytes" (const void *src, Py_ssize_t length)

cdef bint _COMPILED
cdef Py_ssize_t _IDENT_BYTES


cdef inline bint _key_equal(const unsigned char[::1] keys, Py_ssize_t at, bytes ident):
    """The record bytes keys[at : at + 33] equal ident (33 bytes, checked by the caller)."""
    return memcmp(&keys[at], <const char *>ident, 33) == 0

cdef int _EMPTY
cdef Py_ssize_t _RB, _HW, _GROUP, _KM


@cython.final
cdef class KeyIndex:
    cdef dict __dict__
    cdef public object table, hashes, cells, _rows, _idents, _groups, _gmix_np
    cdef public list gmix
    cdef public long long mask, slot_mask, fp_mask
    cdef public int slot_bits
    cdef public Py_ssize_t used
    cdef object _rb
    cdef tuple _views
    cdef unsigned short[::1] _h
    cdef const unsigned char[::1] _keys
    cdef int[::1] _table, _pos
    cdef long long[::1] _hash
    cdef const long long[::1] _gmix
    cdef Py_ssize_t _vacant_cell
    cdef long long _vacant_hash

    cpdef Py_ssize_t key_hash(self, ident, group) except? -1

    cpdef long long stamp(self, long long h) noexcept

    @cython.locals(h=cython.longlong, g=cython.longlong, mask=cython.longlong, p=cython.Py_ssize_t,
                   s=cython.Py_ssize_t, base=cython.Py_ssize_t, c=cython.longlong, stamp=cython.longlong,
                   smask=cython.longlong)
    cpdef Py_ssize_t find(self, ident, group) except? -2

    @cython.locals(p=cython.Py_ssize_t, h=cython.longlong)
    cpdef add_vacant(self, Py_ssize_t slot)

    @cython.locals(mask=cython.longlong, p=cython.Py_ssize_t)
    cpdef add(self, Py_ssize_t slot, long long h)

    @cython.locals(mask=cython.longlong, smask=cython.longlong, p=cython.Py_ssize_t, q=cython.Py_ssize_t,
                   s=cython.Py_ssize_t, c=cython.int)
    cpdef remove(self, Py_ssize_t slot)
