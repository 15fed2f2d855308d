# C types for executor.py's in-order loop (Cython pure Python mode: executor.py is the
# code, this file declares types; see wheeld.protocol.accel). The records reach the
# loop validated (wheeld.protocol.commands.validate_records), as bytes (64 per record).
cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.string cimport memcpy

from wheeld.shm.keyindex cimport KeyIndex, _hash_bytes
from wheeld.shm.wheel cimport TimerWheel

cdef extern from "Python.h":
    object PyUnicode_DecodeUTF8(const char *s, Py_ssize_t size, const char *errors)

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    /* zlib's crc32 (reflected polynomial 0xEDB88320), eight bytes per step ("slicing by 8") */
    static uint32_t wheeld_crc_table[8][256];
    static int wheeld_crc_ready = 0;
    static void wheeld_crc_init(void) {
        uint32_t c;
        int n, k;
        if (wheeld_crc_ready) return;
        for (n = 0; n < 256; n++) {
            c = (uint32_t)n;
            for (k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            wheeld_crc_table[0][n] = c;
        }
        for (n = 0; n < 256; n++)
            for (k = 1; k < 8; k++)
                wheeld_crc_table[k][n] = (wheeld_crc_table[k - 1][n] >> 8) ^ wheeld_crc_table[0][wheeld_crc_table[k - 1][n] & 0xFF];
        wheeld_crc_ready = 1;
    }
    /* zlib.crc32(data, crc) for len bytes at p (wheeld_crc_init first; little-endian host) */
    static inline uint32_t wheeld_crc32(uint32_t crc, const unsigned char *p, size_t len) {
        uint32_t one, two;
        crc = ~crc;
        while (len >= 8) {
            memcpy(&one, p, 4);
            memcpy(&two, p + 4, 4);
            one ^= crc;
            crc = wheeld_crc_table[7][one & 0xFF] ^ wheeld_crc_table[6][(one >> 8) & 0xFF]
                ^ wheeld_crc_table[5][(one >> 16) & 0xFF] ^ wheeld_crc_table[4][one >> 24]
                ^ wheeld_crc_table[3][two & 0xFF] ^ wheeld_crc_table[2][(two >> 8) & 0xFF]
                ^ wheeld_crc_table[1][(two >> 16) & 0xFF] ^ wheeld_crc_table[0][two >> 24];
            p += 8;
            len -= 8;
        }
        while (len--) crc = wheeld_crc_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
        return ~crc;
    }
    """
    void _crc_init "wheeld_crc_init" () nogil
    unsigned int _crc32 "wheeld_crc32" (unsigned int crc, const unsigned char *p, size_t length) nogil

cdef extern from *:
    """
    static inline void wheeld_prefetch(const void *p) { __builtin_prefetch(p); }
    """
    void _prefetch_line "wheeld_prefetch" (const void *p) nogil

cdef extern from *:
    """
    #include <errno.h>
    #include <sys/timerfd.h>
    /* arm the timerfd fd for the absolute CLOCK_MONOTONIC time at_ns (an all-zero
       it_value would disarm it: at least 1 ns); 0 or the errno */
    static int wheeld_timerfd_arm(int fd, long long at_ns) {
        struct itimerspec spec;
        if (at_ns < 1) at_ns = 1;
        memset(&spec, 0, sizeof spec);
        spec.it_value.tv_sec = (time_t)(at_ns / 1000000000LL);
        spec.it_value.tv_nsec = (long)(at_ns % 1000000000LL);
        return timerfd_settime(fd, TFD_TIMER_ABSTIME, &spec, NULL) == 0 ? 0 : errno;
    }
    """
    int _c_timerfd_arm "wheeld_timerfd_arm" (int fd, long long at_ns) nogil

cpdef int timerfd_arm(int fd, long long at_ns)

cdef long _ADD, _ADD_IDLE, _CANCEL, _ACK, _FLUSH
# a ring record's field offsets, set by executor.py from wheeld.protocol.commands (their owner)
cdef Py_ssize_t _RECORD_SIZE, _O_META, _O_RESERVED, _O_SEQ, _O_DEADLINE, _O_AUX0, _O_AUX1, _O_CHECK, _O_PAD, _O_KEY
cdef Py_ssize_t _KEY_FIELD
cdef Py_ssize_t _IW, _I_PREV, _I_NEXT, _I_AUX, _H_CURRENT
cdef long long _MAX_DELAY
cdef bint _COMPILED
# per key meta byte: a valid meta for a keyed command, the key's length, a str key (executor.py)
cdef unsigned char _META_VALID[256]
cdef unsigned char _META_LENGTH[256]
cdef unsigned char _META_STR[256]


cdef inline const unsigned char *_data(bytes raw) noexcept:
    """The bytes of a chunk of records (``raw`` must outlive every use of the pointer)."""
    return <const unsigned char *>PyBytes_AS_STRING(raw)


# the fields of a record at p + at (little-endian host), loaded without alignment
cdef inline unsigned int _u32_at(const unsigned char *p, Py_ssize_t at) noexcept:
    cdef unsigned int value
    memcpy(&value, p + at, 4)
    return value


cdef inline int _i32_at(const unsigned char *p, Py_ssize_t at) noexcept:
    cdef int value
    memcpy(&value, p + at, 4)
    return value


cdef inline long long _i64_at(const unsigned char *p, Py_ssize_t at) noexcept:
    cdef long long value
    memcpy(&value, p + at, 8)
    return value


cdef inline (long, int, unsigned int, long long, int, int) _fields(const unsigned char *p, Py_ssize_t i) noexcept:
    """Record i's (op, key_meta, seq, deadline_ms, aux0, aux1)."""
    cdef Py_ssize_t at = i * _RECORD_SIZE
    return (p[at], p[at + _O_META], _u32_at(p, at + _O_SEQ), _i64_at(p, at + _O_DEADLINE), _i32_at(p, at + _O_AUX0),
            _i32_at(p, at + _O_AUX1))


cdef inline list _keyed_idents(const unsigned char *p, Py_ssize_t n):
    """The 33-byte ident (key_meta byte, then the 32-byte key field) of each keyed command
    (ADD, ADD_IDLE, CANCEL) of n records, in ring order."""
    cdef list idents = []
    cdef bytes ident
    cdef char *out
    cdef const unsigned char *r
    cdef Py_ssize_t i
    for i in range(n):
        r = p + i * _RECORD_SIZE
        if r[0] == _ADD or r[0] == _ADD_IDLE or r[0] == _CANCEL:
            ident = PyBytes_FromStringAndSize(NULL, 1 + _KEY_FIELD)
            out = PyBytes_AS_STRING(ident)
            out[0] = <char>r[_O_META]
            memcpy(out + 1, r + _O_KEY, _KEY_FIELD)
            idents.append(ident)
    return idents


cdef bytes _key_at(bytes raw, Py_ssize_t i)


@cython.locals(wheel=TimerWheel)
cdef object _release(executor, cs, dict unacked, long long epoch, int slot, int generation, unsigned int stamp)


@cython.locals(wheel=TimerWheel, n=Py_ssize_t, i=Py_ssize_t, k=Py_ssize_t, p="const unsigned char *", op=long,
               meta=int, seq="unsigned int", deadline="long long", cur="long long", aux0=int, aux1=int,
               flushes=list, rejects=list, idents=list, ident=bytes, hashes="long long[::1]", unacked=dict,
               epoch="long long", slot=Py_ssize_t, touch=int)
cpdef tuple _in_order(executor, cs, bytes raw)


cdef inline void _hash_keys(KeyIndex index, const unsigned char *p, Py_ssize_t n, long long[::1] hashes,
                            Py_ssize_t gid):
    """hashes[i] = the key index's hash of record i's ident (KeyIndex.key_hash: hash() of the
    33 bytes, mixed with the group's); meaningless for records without a key (ACK, FLUSH)."""
    cdef unsigned char ident[33]
    cdef Py_ssize_t i
    cdef long long mix = index._gmix[gid]
    for i in range(n):
        ident[0] = p[i * _RECORD_SIZE + _O_META]
        memcpy(&ident[1], p + i * _RECORD_SIZE + _O_KEY, _KEY_FIELD)
        hashes[i] = _hash_bytes(ident, 33) ^ mix


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline void _prefetch(TimerWheel wheel, const long long[::1] hashes, Py_ssize_t i, Py_ssize_t n) noexcept:
    """Prefetch what the commands ahead will touch: for command i + 8 the index cell its
    probe starts at; for i + 4 the hash and the record of the slot in that cell if its
    fingerprint is the key's (the key's own record when it is armed); for i + 2 that
    record's neighbours in its bucket (a re-arm or cancel unlinks it). Only hints: every
    index is checked against its view, nothing here can fail."""
    cdef KeyIndex index = wheel._index
    cdef Py_ssize_t records = index._hash.shape[0]
    cdef long long s
    if i + 8 < n:
        _prefetch_line(&index._table[hashes[i + 8] & index.mask])
    if i + 4 < n:
        s = index._table[hashes[i + 4] & index.mask] ^ index.stamp(hashes[i + 4])
        if 0 <= s < records:
            _prefetch_line(&index._hash[s])
            _prefetch_line(&wheel._i[s * _IW])
    if i + 2 < n:
        s = index._table[hashes[i + 2] & index.mask] ^ index.stamp(hashes[i + 2])
        if 0 <= s < records and index._hash[s] == hashes[i + 2]:
            _prefetch_neighbour(wheel, wheel._i[s * _IW + _I_PREV], records)
            _prefetch_neighbour(wheel, wheel._i[s * _IW + _I_NEXT], records)


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline void _prefetch_neighbour(TimerWheel wheel, Py_ssize_t s, Py_ssize_t records) noexcept:
    if 0 <= s < records:
        _prefetch_line(&wheel._i[s * _IW])


cdef inline bint _record_ok(const unsigned char *r, long long touch_limit) except -1:
    """Is the record at r a well-formed command? The rules of
    wheeld.protocol.commands._validate_each, field by field (little-endian host)."""
    cdef Py_ssize_t k, length
    cdef unsigned char op, meta, high
    cdef unsigned short reserved
    cdef long long deadline
    cdef int aux0, aux1
    cdef unsigned int check, pad
    op = r[0]
    meta = r[_O_META]
    memcpy(&reserved, r + _O_RESERVED, 2)
    memcpy(&deadline, r + _O_DEADLINE, 8)
    memcpy(&aux0, r + _O_AUX0, 4)
    memcpy(&aux1, r + _O_AUX1, 4)
    memcpy(&check, r + _O_CHECK, 4)
    memcpy(&pad, r + _O_PAD, 4)
    if reserved or pad:
        return False
    if op == _ADD or op == _ADD_IDLE or op == _CANCEL:
        if not _META_VALID[meta]:
            return False
        length = _META_LENGTH[meta]
    elif op == _ACK or op == _FLUSH:
        if meta:
            return False
        length = 0
    else:
        return False
    high = 0
    for k in range(length, _KEY_FIELD):
        high |= r[_O_KEY + k]
    if high:  # a byte past the key's length
        return False
    if (op == _ADD or op == _CANCEL or op == _FLUSH) and (aux0 or aux1):
        return False
    if (op == _CANCEL or op == _ACK or op == _FLUSH) and deadline:
        return False
    if op == _ADD_IDLE and not (aux0 > 0 and aux1 >= 0 and aux1 < touch_limit):
        return False
    if op == _ACK and aux0 < 0:
        return False
    _crc_init()
    if _crc32(_crc32(0, r, _O_CHECK), r + _O_KEY, _KEY_FIELD) != check:  # zlib.crc32(key, zlib.crc32(head))
        return False
    if length and _META_STR[meta]:
        high = 0
        for k in range(length):
            high |= r[_O_KEY + k]
        if high & 0x80:  # not ASCII: must decode as UTF-8, as bytes.decode("utf-8") would
            try:
                PyUnicode_DecodeUTF8(<const char *>(r + _O_KEY), length, "strict")
            except UnicodeDecodeError:
                return False
    return True


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline int _check_records(const unsigned char[:, ::1] raw, unsigned char[::1] valid,
                               long long touch_limit) except -1:
    """valid[i] = 1 where record i is a well-formed command (_record_ok)."""
    cdef Py_ssize_t i
    for i in range(raw.shape[0]):
        if _record_ok(&raw[i, 0], touch_limit):
            valid[i] = 1
    return 0


cdef inline Py_ssize_t _valid_prefix(bytes raw, long long touch_limit) except -1:
    """How many of the records in raw are well-formed commands (_record_ok) before the first
    that is not."""
    cdef const unsigned char *p = _data(raw)
    cdef Py_ssize_t n = len(raw) // _RECORD_SIZE
    cdef Py_ssize_t i
    for i in range(n):
        if not _record_ok(p + i * _RECORD_SIZE, touch_limit):
            return i
    return n
