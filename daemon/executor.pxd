# C types for executor.py's in-order loop (Cython pure Python mode: executor.py is the
# code, this file declares types; see wheeld.protocol.accel). The records reach the
# loop validated (wheeld.protocol.commands.validate_records).
cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.string cimport memcpy

from wheeld.shm.keyindex cimport KeyIndex
from wheeld.shm.wheel cimport TimerWheel

cdef extern from "Python.h":
    Py_hash_t _Py_HashBytes(const void *src, Py_ssize_t length)  # hash() of a bytes object

cdef extern from *:
    """
    static inline void wheeld_prefetch(const void *p) { __builtin_prefetch(p); }
    """
    void _prefetch_line "wheeld_prefetch" (const void *p) nogil

cdef long _ADD, _ADD_IDLE, _CANCEL, _ACK, _FLUSH
cdef Py_ssize_t _IW, _I_PREV, _I_NEXT
cdef bint _COMPILED


cdef inline bytes _ident_at(const unsigned char[:, ::1] raw, Py_ssize_t i):
    """Record i's key as the wheel's 33-byte ident: its key_meta byte (offset 1), then
    its 32-byte key field (offset 32)."""
    cdef bytes ident = PyBytes_FromStringAndSize(NULL, 33)
    cdef char *out = PyBytes_AS_STRING(ident)
    out[0] = <char>raw[i, 1]
    memcpy(out + 1, &raw[i, 32], 32)
    return ident


@cython.locals(wheel=TimerWheel, n=Py_ssize_t, i=Py_ssize_t, op=long, raw="const unsigned char[:, ::1]",
               ops="const unsigned char[:]", metas="const unsigned char[:]", deadlines="const long long[:]",
               seqs="const unsigned int[:]", aux0="const int[:]", aux1="const int[:]", flushes=list, rejects=list,
               ident=bytes, hashes="long long[::1]")
cpdef tuple _in_order(executor, cs, records)


cdef inline void _hash_keys(KeyIndex index, const unsigned char[:, ::1] raw, long long[::1] hashes, Py_ssize_t gid):
    """hashes[i] = the key index's hash of record i's ident (KeyIndex.key_hash: hash() of the
    33 bytes, mixed with the group's); meaningless for records without a key (ACK, FLUSH)."""
    cdef unsigned char ident[33]
    cdef Py_ssize_t i
    cdef long long mix = index._gmix[gid]
    for i in range(raw.shape[0]):
        ident[0] = raw[i, 1]
        memcpy(&ident[1], &raw[i, 32], 32)
        hashes[i] = _Py_HashBytes(ident, 33) ^ mix


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline void _prefetch(TimerWheel wheel, const long long[::1] hashes, Py_ssize_t i, Py_ssize_t n) noexcept:
    """Prefetch what the commands ahead will touch: for command i + 8 the index cell its
    probe starts at; for i + 4 the hash and the record of the slot in that cell (its own
    record when the key is armed, else the one the probe compares first); for i + 2 that
    record's neighbours in its bucket (a re-arm or cancel unlinks it). Only hints: every
    index is checked against its view, nothing here can fail."""
    cdef KeyIndex index = wheel._index
    cdef Py_ssize_t s, records = index._hash.shape[0]
    if i + 8 < n:
        _prefetch_line(&index._table[hashes[i + 8] & index.mask])
    if i + 4 < n:
        s = index._table[hashes[i + 4] & index.mask]
        if 0 <= s < records:
            _prefetch_line(&index._hash[s])
            _prefetch_line(&wheel._i[s * _IW])
    if i + 2 < n:
        s = index._table[hashes[i + 2] & index.mask]
        if 0 <= s < records and index._hash[s] == hashes[i + 2]:
            _prefetch_neighbour(wheel, wheel._i[s * _IW + _I_PREV], records)
            _prefetch_neighbour(wheel, wheel._i[s * _IW + _I_NEXT], records)


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline void _prefetch_neighbour(TimerWheel wheel, Py_ssize_t s, Py_ssize_t records) noexcept:
    if 0 <= s < records:
        _prefetch_line(&wheel._i[s * _IW])
