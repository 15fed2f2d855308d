# C types for the compiled ring (Cython pure-Python mode: ring.py is the code, this file
# only declares types; see wheeld.protocol.accel).
cimport cython

cdef extern from *:
    """
    /* a compiler barrier: no memory access is moved across it (x86-64 keeps stores in order) */
    static inline void wheeld_store_fence(void) { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
    /* bytes first .. first+7 of a bytes object zero-padded, as a little-endian word (x86-64) */
    static inline unsigned long long wheeld_key_word(PyObject *key_bytes, Py_ssize_t first) {
        Py_ssize_t n = PyBytes_GET_SIZE(key_bytes) - first;
        unsigned long long word = 0;
        if (n > 0) memcpy(&word, PyBytes_AS_STRING(key_bytes) + first, n < 8 ? (size_t)n : 8);
        return word;
    }
    """
    void _store_fence "wheeld_store_fence" () nogil
    unsigned long long _key_word_le "wheeld_key_word" (bytes key_bytes, Py_ssize_t first) noexcept

cdef bint _COMPILED
cdef unsigned long long _U32
cdef unsigned long long _U64
cdef long long _I64_MIN
cdef long long _I64_MAX
cdef long long _I32_MIN
cdef long long _I32_MAX
cdef Py_ssize_t _WORDS_PER_RECORD
cdef Py_ssize_t KEY_FIELD_SIZE
cdef Py_ssize_t _TAIL_WORD
cdef Py_ssize_t _HEAD_WORD
cdef unsigned int _CRC_TABLES[2048]  # a C array: read without bounds checks (every index is < 2048)

@cython.locals(low=cython.ulonglong, high=cython.ulonglong)
cdef inline unsigned long long _crc32_word(unsigned long long crc, unsigned long long word) noexcept

@cython.locals(word=cython.ulonglong, end=Py_ssize_t, i=Py_ssize_t)
cdef inline unsigned long long _key_word(bytes key_bytes, Py_ssize_t length, Py_ssize_t first) except? 0xFFFFFFFFFFFFFFFF


cdef class ClientSegment:
    cdef public object name
    cdef public object _fd
    cdef public object ring_capacity
    cdef public object touch_capacity
    cdef public object is_consumer
    cdef public object _closed
    cdef public object _mm
    cdef public Py_ssize_t _capacity
    cdef public Py_ssize_t _mask
    cdef public object _ring_offset
    cdef public object _view
    cdef public object _words
    cdef public object _last_touch
    cdef public object _idle
    cdef public object _ring
    cdef public object _ring_view
    # the producer's hot state: private tail, cached head, the header words and the ring as 8-byte words
    cdef public unsigned long long _tail
    cdef public unsigned long long _head_cache
    cdef public object _head_limit
    cdef public list kept_marks
    cdef public object _marks_scanned
    cdef unsigned long long[::1] _counters
    cdef unsigned long long[::1] _ring_words
    cdef public object _head
    cdef public object _peeked
    cdef object __weakref__

    @cython.locals(tail=cython.ulonglong)
    cpdef bint push_add(self, key_bytes, key_meta, deadline_ms, seq) except -1
    @cython.locals(tail=cython.ulonglong)
    cpdef bint try_push(self, op, key_bytes=*, key_meta=*, deadline_ms=*, seq=*, aux0=*, aux1=*) except -1
    @cython.locals(tail=cython.ulonglong)
    cpdef bint try_push_record(self, record) except -1
    cdef int _publish(self, unsigned long long tail) except -1
    cdef bint _store_record(self, Py_ssize_t slot, op, key_meta, seq, deadline_ms, aux0, aux1, key_bytes) except -1
    @cython.locals(length=Py_ssize_t, head=cython.ulonglong, deadline=cython.ulonglong, aux=cython.ulonglong,
                   key0=cython.ulonglong, key1=cython.ulonglong, key2=cython.ulonglong, key3=cython.ulonglong,
                   crc=cython.ulonglong, base=Py_ssize_t)
    cdef bint _write_record(self, Py_ssize_t slot, long long op, long long key_meta, long long seq,
                            long long deadline_ms, long long aux0, long long aux1, bytes key_bytes) except -1
