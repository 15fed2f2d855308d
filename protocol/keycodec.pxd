# The key format of wheeld.protocol.keys in C, for the compiled modules that build a key
# object from its bytes: shm/wheel.pxd (a fired or advanced record's key) and
# client/core.pxd (an expiration's key), and the 33-byte record form of the usual keys
# (shm/wheel.pxd: the scalar methods that take a user key). keys.py owns the format; the modules that cimport
# this compare _kc_layout() with it at import (see wheel.py and core.py) and refuse to load
# if they differ. tests/test_c_twins.py holds decode_key_c to keys.decode_key.
#
# A .pxd with only C constants and inline functions: each module that cimports it compiles
# its own copy; there is no module of this name at run time.
cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.long cimport PyLong_FromLongLong
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.string cimport memcpy, memset


cdef extern from "Python.h":
    const char *PyUnicode_AsUTF8AndSize(object, Py_ssize_t *) except NULL
    long long PyLong_AsLongLongAndOverflow(object, int *) except? -1

cdef enum:
    _KC_TYPE_SHIFT = 6  # a meta byte: the key's type above, its encoded length below
    _KC_LEN_MASK = 0x3F
    _KC_TYPE_BYTES = 0
    _KC_TYPE_STR = 1
    _KC_TYPE_INT = 2
    _KC_INT_BYTES = 8  # an int key: 8 bytes, little-endian, signed
    _KC_KEY_BYTES = 32


@cython.final
cdef inline tuple _kc_layout():
    """The constants above, in the order the cimporting modules compare them with keys.py."""
    return (_KC_TYPE_SHIFT, _KC_LEN_MASK, _KC_TYPE_BYTES, _KC_TYPE_STR, _KC_TYPE_INT, _KC_INT_BYTES,
            _KC_KEY_BYTES)


cdef inline object decode_key_c(const unsigned char *p, Py_ssize_t n, long long meta, object whole):
    """keys.decode_key of the ``n`` key bytes at ``p`` for a meta byte encode_key can write (a
    known type, a length of 1..32 that is ``n``, 8 bytes for an int); None for any other
    (the caller then decodes the Python way, with the same result and errors). A str key
    not in UTF-8 raises UnicodeDecodeError, as bytes.decode does. ``whole``: the bytes
    object that is exactly the key (returned for a bytes key, no copy), or None."""
    cdef long long kind = meta >> _KC_TYPE_SHIFT
    cdef long long length = meta & _KC_LEN_MASK
    cdef unsigned long long v = 0
    cdef int k
    if meta < 0 or meta > 0xFF or length < 1 or length > _KC_KEY_BYTES or n != length:
        return None
    if kind == _KC_TYPE_STR:
        return PyUnicode_DecodeUTF8(<const char *>p, n, NULL)
    if kind == _KC_TYPE_BYTES:
        return whole if whole is not None else PyBytes_FromStringAndSize(<const char *>p, n)
    if kind == _KC_TYPE_INT and n == _KC_INT_BYTES:
        for k in range(_KC_INT_BYTES - 1, -1, -1):
            v = (v << 8) | p[k]
        return PyLong_FromLongLong(<long long>v)
    return None


cdef inline object encode_ident_c(object key):
    """The 33-byte record form (meta byte, key bytes, zero padding) of keys.encode_key's two
    usual keys, built in one bytes object: a str of 1..32 UTF-8 bytes, an int in int64. None
    for any other key (a subclass, bytes, a str with a lone surrogate, too long, empty, an
    int out of range): the caller then encodes it the Python way, with the same result or
    error."""
    cdef const char *p
    cdef Py_ssize_t n
    cdef long long v
    cdef unsigned long long u
    cdef int overflow = 0, k
    cdef bytes out
    cdef char *o
    if type(key) is str:
        try:
            p = PyUnicode_AsUTF8AndSize(key, &n)
        except UnicodeEncodeError:
            return None
        if n < 1 or n > _KC_KEY_BYTES:
            return None
        out = PyBytes_FromStringAndSize(NULL, 1 + _KC_KEY_BYTES)
        o = PyBytes_AS_STRING(out)
        o[0] = <char>((_KC_TYPE_STR << _KC_TYPE_SHIFT) | n)
        memcpy(o + 1, p, n)
        memset(o + 1 + n, 0, _KC_KEY_BYTES - n)
        return out
    if type(key) is int:
        v = PyLong_AsLongLongAndOverflow(key, &overflow)
        if overflow:
            return None
        u = <unsigned long long>v
        out = PyBytes_FromStringAndSize(NULL, 1 + _KC_KEY_BYTES)
        o = PyBytes_AS_STRING(out)
        o[0] = <char>((_KC_TYPE_INT << _KC_TYPE_SHIFT) | _KC_INT_BYTES)
        for k in range(_KC_INT_BYTES):
            o[1 + k] = <char>((u >> (8 * k)) & 0xFF)
        memset(o + 1 + _KC_INT_BYTES, 0, _KC_KEY_BYTES - _KC_INT_BYTES)
        return out
    return None
