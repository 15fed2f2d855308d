# C types for executor.py's in-order loop (Cython pure Python mode: executor.py is the
# code, this file declares types; see wheeld.protocol.accel). The records reach the
# loop validated (wheeld.protocol.commands.validate_records).
cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.string cimport memcpy

from wheeld.shm.wheel cimport TimerWheel

cdef long _ADD, _ADD_IDLE, _CANCEL, _ACK, _FLUSH
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
               ident=bytes)
cpdef tuple _in_order(executor, cs, records)
