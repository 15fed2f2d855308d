# C declarations of shm/wheel.py for the compiled build (Cython pure Python mode): the
# scalar paths (schedule, cancel, re-arm, advance/expire, release, rearm_fired) in C, and
# the C loops of the batch methods (the functions after the class, _c_*).
cimport cython
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memcpy, memset

from wheeld.protocol.keycodec cimport _KC_LEN_MASK, _kc_layout, decode_key_c, encode_ident_c

from .keyindex cimport KeyIndex, _hash_bytes
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
    """keys.decode_key of the key bytes at b[at] (a record's key field, 32 bytes): the
    shared decoder (protocol/keycodec.pxd), None for a meta byte encode_key never writes."""
    return decode_key_c(&b[at], meta & _KC_LEN_MASK, meta, None)

cdef bytes _ident_of(object key)  # wheel.py's encode_ident, called in C by the scalar methods
cdef int _FREE, _SCHEDULED, _FIRED, _STATE_MASK, _LEVEL_SHIFT
cdef Py_ssize_t _CUR, _QW, _IW, _HW, _RB, _PREV, _NEXT, _GEN, _TAG, _AUX, _GROUP, _ST, _KM, _KEY
cdef Py_ssize_t _INTENT_SLOT, _INTENT_STATE, _INTENT_TAG, _INTENT_DEADLINE
cdef Py_ssize_t _C_PENDING, _C_FIRED_UNACKED, _C_ADDS, _C_REARMS, _C_CANCELS, _C_CANCEL_MISSES, _C_EXPIRATIONS
cdef Py_ssize_t _C_CASCADES, _C_ACKS, _C_IDLE_REARMS, _C_ARENA_FULL
cdef tuple _OWN_WORDS, _LEVEL_WORDS
cdef Py_ssize_t _DUE_WORD
cdef long long _TOUCH_INDEX_BITS, _TOUCH_INDEX_MASK, _MAX_IDLE_MS
cdef object _NO_VIEWS


cdef class WheelRecords:
    cdef dict __dict__
    cdef public object _seg, records, _hq, _rb, max_groups
    cdef public Py_ssize_t first_entry, n_records, due_list, fired_list, _free_top
    cdef public Placement _placement
    cdef public KeyIndex _index
    cdef public list _heap, _queued
    cdef public long long[::1] _pending_by_level, _group_live, _ahead_memo
    # the arena's words and bytes, and the free stack, as C arrays (public: the wheel's
    # rooms, Python mixins, read them too)
    cdef public long long[::1] _clock, _q, _count
    cdef public int[::1] _hi, _i, _free_stack
    cdef public unsigned int[::1] _hu, _u
    cdef public unsigned short[::1] _h
    cdef public unsigned char[::1] _b
    # the compiled path's bucket heap: (expiration, sentinel) pairs in C arrays (_c_heap_*)
    cdef long long[::1] _hx
    cdef int[::1] _hb
    cdef Py_ssize_t _hn

    # The steps of a record and the heap: final (direct C calls, from TimerWheel too).
    @cython.final
    @cython.locals(b=cython.Py_ssize_t, expiration=cython.longlong, level=cython.longlong,
                   bp=cython.Py_ssize_t, tail=cython.Py_ssize_t, sp=cython.Py_ssize_t)
    cdef int _link(self, Py_ssize_t slot, long long deadline, long long cur) except -1

    @cython.final
    @cython.locals(sp=cython.Py_ssize_t, prev=cython.Py_ssize_t, nxt=cython.Py_ssize_t)
    cdef void _unlink(self, Py_ssize_t slot)

    @cython.final
    @cython.locals(old_state=cython.int, new_state=cython.int)
    cdef void _rearm(self, Py_ssize_t slot, long long deadline_ms, long long tag, long long cur)

    @cython.final
    cdef void _apply_with_intent(self, Py_ssize_t slot, int state, long long deadline_ms, long long tag)

    @cython.final
    @cython.locals(state=cython.int, sp=cython.Py_ssize_t, prev=cython.Py_ssize_t, nxt=cython.Py_ssize_t)
    cdef void _remove_scheduled(self, Py_ssize_t slot, Py_ssize_t group)

    @cython.final
    cdef void _free(self, Py_ssize_t slot)

    @cython.final
    @cython.locals(fl=cython.Py_ssize_t, flp=cython.Py_ssize_t, tail=cython.Py_ssize_t)
    cdef void _fire(self, Py_ssize_t s, list out)

    @cython.final
    cdef void _queue_bucket(self, Py_ssize_t b, long long expiration) except *

    cpdef list _due_buckets(self, now_ms)

    @cython.locals(hq=cython.longlong[::1], count=cython.longlong[::1], by_level=cython.longlong[::1],
                   j=cython.Py_ssize_t, level=cython.Py_ssize_t)
    cpdef publish_stats(self)

    @cython.locals(hq=cython.longlong[::1])
    cpdef store_words(self, dict word_of, dict values)

    @cython.locals(i=cython.int[::1], examined=list, s=Py_ssize_t, b=Py_ssize_t, start=Py_ssize_t)
    cpdef cascade_ahead(self, now_ms, max_entries)

    @cython.final
    @cython.locals(i=cython.int[::1], moved=Py_ssize_t, s=Py_ssize_t, nxt=Py_ssize_t, deadline=cython.longlong)
    cdef Py_ssize_t _move_each_to_level0(self, Py_ssize_t start, Py_ssize_t b, Py_ssize_t max_entries,
                                         long long expiration, long long pass_cur, long long cur) except -1


# TimerWheel: the operations over WheelRecords, with its rooms (Python mixins:
# wheel_groups, wheel_attach, wheel_batch). Final: its cpdef methods are called directly,
# with no check for an override, from what types a wheel as TimerWheel (the executor,
# the purgatory) and from its own methods.
@cython.final
cdef class TimerWheel(WheelRecords):
    @cython.locals(cur=cython.longlong, deadline=cython.longlong, g=cython.Py_ssize_t, t=cython.longlong,
                   a=cython.longlong, slot=cython.Py_ssize_t, top=cython.Py_ssize_t,
                   sp=cython.Py_ssize_t, gen=cython.longlong, base=cython.Py_ssize_t, state=cython.int)
    cpdef tuple schedule_ident(self, ident, deadline_ms, group=*, tag=*, aux=*)

    @cython.locals(slot=cython.Py_ssize_t)
    cpdef bint cancel_ident(self, ident, group=*) except -1

    @cython.locals(out=list, i=cython.int[::1], b=cython.Py_ssize_t, bp=cython.Py_ssize_t, s=cython.Py_ssize_t)
    cdef list _collect(self, now_ms)

    @cython.locals(slots=list, now=cython.longlong, q=cython.longlong[::1], b=cython.uchar[::1], by_level=cython.longlong[::1],
                   cur=cython.longlong, fired=cython.Py_ssize_t, cascaded=cython.Py_ssize_t, s=cython.Py_ssize_t,
                   deadline=cython.longlong, state=cython.int, c=cython.longlong[::1], base=cython.Py_ssize_t,
                   meta=cython.int, index=KeyIndex, touched=cython.Py_ssize_t, views=dict, aux=cython.longlong,
                   rearm_at=cython.longlong)
    cdef Py_ssize_t _sweep(self, now_ms, bint to_fired, list out, object sources, list rearmed) except -1

    @cython.locals(client=cython.longlong, index=cython.Py_ssize_t, last_touch=cython.longlong, idle_ms=cython.longlong,
                   rearm_at=cython.longlong)
    cdef Py_ssize_t _touched_deadline(self, long long aux, long long now, long long floor, object sources, dict views,
                                     Py_ssize_t slot, long long deadline, list rearmed) except -1

    @cython.locals(cur=cython.longlong, tick=cython.longlong, size=cython.longlong, views=dict, moved=cython.Py_ssize_t,
                   v0=cython.longlong, b=cython.Py_ssize_t, s=cython.Py_ssize_t, after=cython.Py_ssize_t,
                   aux=cython.longlong, deadline=cython.longlong, rearm_at=cython.longlong, budget=cython.Py_ssize_t,
                   tail=cython.Py_ssize_t, idle_seen=cython.bint)
    cpdef Py_ssize_t rearm_touched_ahead(self, now_ms, horizon_ms, max_entries, sources, list rearmed=*) except -1

    @cython.final
    @cython.locals(m=cython.Py_ssize_t)
    cdef bint _ahead_walked(self, Py_ssize_t b, long long expiration, Py_ssize_t tail) noexcept

    @cython.final
    @cython.locals(m=cython.Py_ssize_t)
    cdef void _ahead_remember(self, Py_ssize_t b, long long expiration, Py_ssize_t tail) noexcept

    @cython.locals(out=list)
    cpdef list advance(self, now_ms)

    @cython.locals(out=list, fired=cython.Py_ssize_t)
    cpdef list expire(self, now_ms, sources=*, list rearmed=*)

    @cython.locals(c=cython.longlong[::1])
    cpdef bint release(self, slot, generation) except -1

    @cython.locals(cur=cython.longlong, deadline=cython.longlong, base=cython.Py_ssize_t, group=cython.Py_ssize_t,
                   state=cython.int, c=cython.longlong[::1])
    cpdef bint rearm_fired(self, slot, generation, deadline_ms) except -1

    @cython.locals(out=list, s=Py_ssize_t, sp=Py_ssize_t, base=Py_ssize_t)
    cpdef list record_rows(self, slots)


# ---------------------------------------------------------------------------- batch methods
# The C loops of the batch methods (schedule_many, cancel_many, expire_many, release_many).
# They read the callers' buffers and the arena through C pointers: no Python object per
# item. Each has the meaning of the numpy code of the Python path and leaves the same
# bytes in the arena (see the comments at the batch methods in wheel.py); the key index is
# probed, filled and emptied as by KeyIndex.find/add/remove. Every index read from the
# arena (a link, a group id) is checked before it is used; a bad one raises ``corrupt``
# (the caller passes CorruptArena).

cdef extern from *:
    """
    #ifndef WHEELD_WHEEL_PREFETCH
    #define WHEELD_WHEEL_PREFETCH
    /* the empty volatile asm makes the call a side effect: a function that only
       prefetches is otherwise taken for a pure one, and gcc drops the calls to it */
    static inline void wheeld_wheel_prefetch(const void *p) {
        __builtin_prefetch(p);
        __asm__ __volatile__("" : : "r"(p));
    }
    #define WHEELD_EXACT_RANGE (1LL << 62)
    #endif
    """
    void _pf "wheeld_wheel_prefetch" (const void *p) nogil
    long long _CW_EXACT_RANGE "WHEELD_EXACT_RANGE"  # placement._EXACT_RANGE

# The record layout (wheeld.protocol.arena_layout) as C constants; wheel.py checks them
# against the layout at import (_c_layout).
cdef enum:
    _CW_IW = 16  # int32 words per record
    _CW_QW = 8  # int64 words per record
    _CW_HW = 32  # uint16 words per record
    _CW_RB = 64  # bytes per record
    _CW_PREV = 2  # int32 word: prev link
    _CW_NEXT = 3  # int32 word: next link
    _CW_GEN = 4  # int32 word: generation
    _CW_TAG = 5  # int32 word: tag
    _CW_AUX = 6  # int32 word: aux
    _CW_GROUP = 14  # uint16 word: group id
    _CW_ST = 30  # byte: state
    _CW_KM = 31  # byte: key meta, then the 32 key bytes
    _CW_IDENT = 33  # key meta + key
    _CW_FREE = 0
    _CW_SCHEDULED = 1
    _CW_FIRED = 2
    _CW_LEVEL_SHIFT = 4
    _CW_DUE_LEVEL = 15
    _CW_CUR = 5  # int64 header word: the clock
    _CW_INTENT_COUNT = 21  # int32 header word: the batch intent's count
    _CW_INTENT_MAX = 4096  # batch intent entries
    _CW_INTENT_ENTRY = 16  # bytes per entry: slot i32, tag u32, deadline i64
    _CW_GEN_MASK = 0x7FFFFFFF
    _CW_AHEAD = 8  # prefetch distances (items ahead), see _c_prefetch_probe
    _CW_AHEAD2 = 16
    _CW_AHEAD3 = 32
    _CW_PROBE = 8  # index cells of a probe prefetched


cdef inline tuple _c_layout():
    """The constants above, in the order wheel.py compares them with arena_layout."""
    return (_CW_IW, _CW_QW, _CW_HW, _CW_RB, _CW_PREV, _CW_NEXT, _CW_GEN, _CW_TAG, _CW_AUX, _CW_GROUP, _CW_ST,
            _CW_KM, _CW_IDENT, _CW_FREE, _CW_SCHEDULED, _CW_FIRED, _CW_LEVEL_SHIFT, _CW_DUE_LEVEL, _CW_CUR,
            _CW_INTENT_COUNT, _CW_INTENT_MAX, _CW_INTENT_ENTRY, _CW_GEN_MASK)


cdef struct _Arena:
    long long *q  # the records as int64 words
    int *i  # ... int32 words
    unsigned int *u  # ... uint32 words
    unsigned short *h  # ... uint16 words
    unsigned char *b  # ... bytes
    long long *by_level  # pending timers per level (the wheel's derived counts)
    Py_ssize_t n  # records (sentinels included)
    Py_ssize_t first  # the first entry record


cdef struct _Index:
    int *table  # the key index's cells (slot | fingerprint, or -1)
    long long smask, fmask  # KeyIndex.slot_mask, fp_mask
    int sbits  # KeyIndex.slot_bits
    long long *hash  # per slot: its key's hash
    int *pos  # per slot: its cell, or -1
    const long long *gmix  # per group id: the hash mix
    unsigned long long mask


cdef struct _Slots:  # a growing array of slots
    Py_ssize_t *data
    Py_ssize_t size, cap


cdef inline int _c_views(WheelRecords w, _Arena *a, _Index *x) except -1:
    """C pointers into the wheel's views (their lengths cover every record)."""
    cdef KeyIndex index = w._index
    a.q = &w._q[0]
    a.i = &w._i[0]
    a.u = &w._u[0]
    a.h = &w._h[0]
    a.b = &w._b[0]
    a.by_level = &w._pending_by_level[0]
    a.n = w.n_records
    a.first = w.first_entry
    x.table = &index._table[0]
    x.hash = &index._hash[0]
    x.pos = &index._pos[0]
    x.gmix = &index._gmix[0]
    x.mask = <unsigned long long>index.mask
    x.smask = index.slot_mask
    x.fmask = index.fp_mask
    x.sbits = index.slot_bits
    return 0


cdef inline long long _c_stamp(_Index *x, long long h) noexcept nogil:
    """KeyIndex.stamp: the fingerprint bits of a cell holding a key with hash h."""
    return ((h >> 33) & x.fmask) << x.sbits


cdef inline int _c_push(_Slots *v, Py_ssize_t s) except -1:
    cdef Py_ssize_t cap
    cdef Py_ssize_t *data
    if v.size == v.cap:
        cap = 2 * v.cap if v.cap else 1024
        data = <Py_ssize_t *>realloc(v.data, cap * sizeof(Py_ssize_t))
        if data == NULL:
            raise MemoryError()
        v.data = data
        v.cap = cap
    v.data[v.size] = s
    v.size += 1
    return 0


# ------------------------------------------------------------------ the bucket heap
# The compiled path keeps the heap of bucket expirations (TimerWheel._heap on the Python
# path, a heapq list of (expiration, sentinel) tuples) as a binary min-heap of the same
# pairs in two C arrays. Entries come off it in the same order ((expiration, sentinel)
# ascending), and stale ones (their bucket re-queued or emptied) are skipped the same way,
# through TimerWheel._queued.
cdef inline bint _c_heap_before(long long e1, Py_ssize_t b1, long long e2, Py_ssize_t b2) noexcept nogil:
    return e1 < e2 or (e1 == e2 and b1 < b2)


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline int _c_heap_push(WheelRecords w, long long e, Py_ssize_t b) except -1:
    """heapq.heappush(heap, (e, b))."""
    cdef Py_ssize_t i, parent
    cdef long long *hx
    cdef int *hb
    if w._hn == w._hx.shape[0]:
        w._heap_grow()
    hx = &w._hx[0]
    hb = &w._hb[0]
    i = w._hn
    w._hn += 1
    while i > 0:
        parent = (i - 1) >> 1
        if not _c_heap_before(e, b, hx[parent], hb[parent]):
            break
        hx[i] = hx[parent]
        hb[i] = hb[parent]
        i = parent
    hx[i] = e
    hb[i] = <int>b
    return 0


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline void _c_heap_pop(WheelRecords w) noexcept:
    """heapq.heappop(heap) of a non-empty heap (the top is read before)."""
    cdef Py_ssize_t i = 0, c, n
    cdef long long e
    cdef int b
    cdef long long *hx = &w._hx[0]
    cdef int *hb = &w._hb[0]
    w._hn -= 1
    n = w._hn
    e = hx[n]
    b = hb[n]
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and _c_heap_before(hx[c + 1], hb[c + 1], hx[c], hb[c]):
            c += 1
        if not _c_heap_before(hx[c], hb[c], e, b):
            break
        hx[i] = hx[c]
        hb[i] = hb[c]
        i = c
    hx[i] = e
    hb[i] = b


cdef inline int _c_heap_fill(WheelRecords w, list entries) except -1:
    """The heap of the (expiration, sentinel) pairs ``entries`` (TimerWheel._fill_heap)."""
    w._hn = 0
    for e, b in entries:
        _c_heap_push(w, e, b)
    return 0


cdef inline bint _c_queued_at(list queued, Py_ssize_t b, long long e) except -1:
    """queued[b] == e (queued: TimerWheel._queued, a list of ints)."""
    cdef long long q = queued[b]
    return q == e


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline object _c_next_deadline(WheelRecords w):
    """TimerWheel.next_deadline: the top entry of a live non-empty bucket, popping the others."""
    cdef long long e
    cdef Py_ssize_t b
    cdef list queued = w._queued
    while w._hn:
        e = w._hx[0]
        b = w._hb[0]
        if _c_queued_at(queued, b, e) and w._i[b * _CW_IW + _CW_NEXT] != b:
            return e
        _c_heap_pop(w)  # stale: the bucket was emptied by cancels or re-queued
        if _c_queued_at(queued, b, e):
            queued[b] = -1
    return None


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline list _c_due_buckets(WheelRecords w, long long now):
    """TimerWheel._due_buckets: the live non-empty buckets due at ``now``, off the heap."""
    cdef long long e
    cdef Py_ssize_t b
    cdef list queued = w._queued, out = []
    while w._hn and w._hx[0] <= now:
        e = w._hx[0]
        b = w._hb[0]
        _c_heap_pop(w)
        if not _c_queued_at(queued, b, e):
            continue
        queued[b] = -1
        if w._i[b * _CW_IW + _CW_NEXT] != b:  # else emptied by cancels
            out.append(b)
    return out


# ------------------------------------------------------------------ the key index (KeyIndex.find/add/remove)
cdef inline Py_ssize_t _c_find(_Index *x, _Arena *a, long long h, Py_ssize_t g, const unsigned char *ident) noexcept nogil:
    """KeyIndex.find: the slot indexed under key (g, ident) with hash h, or -1."""
    cdef unsigned long long p = <unsigned long long>h & x.mask
    cdef long long stamp = _c_stamp(x, h), c, s
    while True:
        c = x.table[p]
        if c == -1:
            return -1
        s = c ^ stamp  # the slot, if the fingerprint matches
        if s <= x.smask and x.hash[s] == h and a.h[s * _CW_HW + _CW_GROUP] == g \
                and memcmp(a.b + s * _CW_RB + _CW_KM, ident, _CW_IDENT) == 0:
            return <Py_ssize_t>s
        p = (p + 1) & x.mask


cdef inline void _c_index_add(_Index *x, Py_ssize_t slot, long long h) noexcept nogil:
    """KeyIndex.add (the caller counts KeyIndex.used)."""
    cdef unsigned long long p = <unsigned long long>h & x.mask
    while x.table[p] >= 0:
        p = (p + 1) & x.mask
    x.table[p] = <int>(slot | _c_stamp(x, h))
    x.hash[slot] = h
    x.pos[slot] = <int>p


cdef inline void _c_index_remove(_Index *x, Py_ssize_t slot) noexcept nogil:
    """KeyIndex.remove (backward-shift deletion) of an indexed slot (the caller counts
    KeyIndex.used)."""
    cdef unsigned long long p = <unsigned long long>x.pos[slot], q = p
    cdef Py_ssize_t s
    cdef int c
    x.pos[slot] = -1
    while True:
        q = (q + 1) & x.mask
        c = x.table[q]
        if c == -1:
            break
        s = c & x.smask
        if ((q - <unsigned long long>x.hash[s]) & x.mask) >= ((q - p) & x.mask):
            x.table[p] = c
            x.pos[s] = <int>p
            p = q
    x.table[p] = -1


cdef inline void _c_prefetch_probe(_Index *x, _Arena *a, const long long *hashes, Py_ssize_t j, Py_ssize_t n,
                                   bint removing) noexcept nogil:
    """Prefetch what the probes of the items ahead read, in three stages (each reads what
    the one before fetched): for item j + _CW_AHEAD3 the index cell its probe starts at;
    for j + _CW_AHEAD2 the hashes of the slots in the cells from there to the first empty
    one (at most _CW_PROBE of them) whose fingerprint is the item's, or of all of them when
    ``removing`` (a removal's backward shift reads the hashes of the cells after the
    key's); for j + _CW_AHEAD the record of the first of those slots with the item's
    hash (its own when its key is indexed). Hints only: nothing is read outside the index."""
    cdef unsigned long long p
    cdef Py_ssize_t k
    cdef long long h, stamp, c, s
    if j + _CW_AHEAD3 < n:
        _pf(&x.table[<unsigned long long>hashes[j + _CW_AHEAD3] & x.mask])
    if j + _CW_AHEAD2 < n:
        h = hashes[j + _CW_AHEAD2]
        stamp = _c_stamp(x, h)
        p = <unsigned long long>h & x.mask
        for k in range(_CW_PROBE):
            c = x.table[p]
            if c < 0:
                break
            s = c ^ stamp
            if s <= x.smask or removing:
                _pf(&x.hash[c & x.smask])
            p = (p + 1) & x.mask
    if j + _CW_AHEAD < n:
        h = hashes[j + _CW_AHEAD]
        stamp = _c_stamp(x, h)
        p = <unsigned long long>h & x.mask
        for k in range(_CW_PROBE):
            c = x.table[p]
            if c < 0:
                break
            s = c ^ stamp
            if s <= x.smask and x.hash[s] == h:
                _pf(a.b + s * _CW_RB)
                break
            p = (p + 1) & x.mask


cdef inline void _c_prefetch_removal(_Index *x, const long long *slots, Py_ssize_t j, Py_ssize_t n) noexcept nogil:
    """Prefetch what removing the indexed slots ahead from the index reads: for slot
    j + _CW_AHEAD2 its cell, for j + _CW_AHEAD the hashes of the slots in the cells after
    it (at most _CW_PROBE: a removal moves them back). The slots' cells (KeyIndex.cells)
    were fetched before."""
    cdef unsigned long long p
    cdef Py_ssize_t k
    cdef int c
    if j + _CW_AHEAD2 < n and x.pos[slots[j + _CW_AHEAD2]] >= 0:
        _pf(&x.table[x.pos[slots[j + _CW_AHEAD2]]])
    if j + _CW_AHEAD < n and x.pos[slots[j + _CW_AHEAD]] >= 0:
        p = <unsigned long long>x.pos[slots[j + _CW_AHEAD]]
        for k in range(_CW_PROBE):
            p = (p + 1) & x.mask
            c = x.table[p]
            if c < 0:
                break
            _pf(&x.hash[c & x.smask])


cdef inline void _c_prefetch_links(_Arena *a, Py_ssize_t s) noexcept nogil:
    """Prefetch the records linked before and after record s (an unlink writes them)."""
    cdef Py_ssize_t p = a.i[s * _CW_IW + _CW_PREV], nx = a.i[s * _CW_IW + _CW_NEXT]
    if 0 <= p < a.n:
        _pf(a.b + p * _CW_RB)
    if 0 <= nx < a.n:
        _pf(a.b + nx * _CW_RB)


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline bint _c_hash_idents(WheelRecords w, const unsigned char[::1] idents, const long long[:] groups,
                                long long[::1] hashes, const unsigned char[::1] valid_meta, bint check_meta) except -1:
    """hashes[j] = item j's key hash (KeyIndex.key_hash: hash() of its 33 bytes, mixed with its
    group's); groups are checked by the caller (one per item, or one for all: a column of
    the C loops). With ``check_meta``, True (and nothing hashed)
    when an item's meta byte is not a key's."""
    cdef KeyIndex index = w._index
    cdef const long long *gmix = &index._gmix[0]
    cdef const unsigned char *raw = &idents[0]
    cdef Py_ssize_t j, n = hashes.shape[0], gs = groups.shape[0] != 1
    if check_meta:
        for j in range(n):
            if not valid_meta[raw[j * _CW_IDENT]]:
                return True
    for j in range(n):
        hashes[j] = _hash_bytes(raw + j * _CW_IDENT, _CW_IDENT) ^ gmix[groups[j * gs]]
    return False


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline bint _c_has_duplicates(const long long[::1] values) except -1:
    """Some value occurs twice (arrays.has_duplicates): a hash set of the values' positions."""
    cdef Py_ssize_t n = values.shape[0], size = 16, j
    cdef unsigned long long mask, p
    cdef int *cells
    cdef bint found = False
    while size < 2 * n:
        size *= 2
    mask = size - 1
    cells = <int *>malloc(size * sizeof(int))
    if cells == NULL:
        raise MemoryError()
    memset(cells, 0xFF, size * sizeof(int))
    for j in range(n):
        p = (<unsigned long long>values[j] * 0x9E3779B97F4A7C15ULL) >> 40 & mask
        while cells[p] >= 0 and values[cells[p]] != values[j]:
            p = (p + 1) & mask
        if cells[p] >= 0:
            found = True
            break
        cells[p] = <int>j
    free(cells)
    return found


# ------------------------------------------------------------------ links
cdef inline bint _c_unlink(_Arena *a, Py_ssize_t s) noexcept nogil:
    """TimerWheel._unlink of record s; False (nothing written) if a link is out of range."""
    cdef Py_ssize_t p = a.i[s * _CW_IW + _CW_PREV], nx = a.i[s * _CW_IW + _CW_NEXT]
    if not (0 <= p < a.n and 0 <= nx < a.n):
        return False
    a.i[p * _CW_IW + _CW_NEXT] = <int>nx
    a.i[nx * _CW_IW + _CW_PREV] = <int>p
    return True


cdef inline bint _c_member(_Arena *a, Py_ssize_t s) noexcept nogil:
    """Record s is one being unlinked by _c_unlink_freed: an entry record in state FREE."""
    return s >= a.first and a.b[s * _CW_RB + _CW_ST] == _CW_FREE


cdef inline int _c_unlink_freed(_Arena *a, const Py_ssize_t *slots, Py_ssize_t k, object corrupt) except -1:
    """TimerWheel._unlink_many of distinct records already committed FREE, with the same bytes.

    The freed records form runs (neighbours in one list); each run is found from its
    head (the member whose prev is not a member) and its neighbours are linked to each
    other. The members' own links stay as they are when the batch is one run, or when
    no run is longer than one record; otherwise each member's links are set to its
    run's neighbours (what the pointer jumping of the numpy code leaves)."""
    cdef Py_ssize_t c, s, t, p, nx, length, runs = 0, longest = 0
    for c in range(k):
        s = slots[c]
        p = a.i[s * _CW_IW + _CW_PREV]
        if not 0 <= p < a.n:
            raise corrupt(f"record {s} links to {p}, outside the records")
        if _c_member(a, p):
            continue
        t = s
        length = 1
        while True:
            nx = a.i[t * _CW_IW + _CW_NEXT]
            if not 0 <= nx < a.n:
                raise corrupt(f"record {t} links to {nx}, outside the records")
            if not _c_member(a, nx):
                break
            t = nx
            length += 1
            if length > k:
                raise corrupt("a cycle of free records in a list")
        a.i[p * _CW_IW + _CW_NEXT] = <int>nx
        a.i[nx * _CW_IW + _CW_PREV] = <int>p
        runs += 1
        if length > longest:
            longest = length
    if runs < 2 or longest < 2:
        return 0
    for c in range(k):
        s = slots[c]
        p = a.i[s * _CW_IW + _CW_PREV]
        if _c_member(a, p):
            continue
        t = s
        while _c_member(a, a.i[t * _CW_IW + _CW_NEXT]):  # checked in range by the first pass
            t = a.i[t * _CW_IW + _CW_NEXT]
        nx = a.i[t * _CW_IW + _CW_NEXT]
        t = s
        while True:
            length = a.i[t * _CW_IW + _CW_NEXT]  # the next member (read before it is overwritten)
            a.i[t * _CW_IW + _CW_PREV] = <int>p
            a.i[t * _CW_IW + _CW_NEXT] = <int>nx
            if length == nx:
                break
            t = length
    return 0


# ------------------------------------------------------------------ placement (Placement.place)
cdef struct _Place:
    long long cur  # the clock of the batch
    bint exact  # Placement.place computes in 64 bits (else every item goes through TimerWheel._link)
    Py_ssize_t levels, ws, due
    long long wmask  # ws - 1 when ws is a power of two, else -1
    long long tk[15]  # per level: tick
    long long up[15]  # ... what is added before dividing (level 0 rounds up)
    long long reach[15]  # ... the reach
    long long cdiv[15]  # ... cur // tick
    int shift[15]  # ... log2(tick) when the tick is a power of two, else -1


@cython.cdivision(True)
cdef inline long long _c_floordiv(long long a, long long t, int shift) noexcept nogil:
    """a // t (rounded down, as Python does) for t > 0; a shift when t is 2**shift."""
    cdef long long q
    if shift >= 0:
        return a >> shift  # an arithmetic shift: rounds down
    q = a // t
    if a - q * t < 0:  # q was rounded toward zero (not by the remainder's sign: Cython may floor `//`
        q -= 1         # and not `%`, and a q floored already must not move again)
    return q


cdef inline int _c_place_init(_Place *pl, Placement placement, long long cur) except -1:
    """The placement rule of one batch (every item placed relative to ``cur``)."""
    cdef Py_ssize_t level
    cdef long long t
    cdef int k
    pl.cur = cur
    pl.levels = placement._n
    pl.ws = placement._ws
    pl.due = placement._due
    pl.wmask = pl.ws - 1 if pl.ws & (pl.ws - 1) == 0 else -1
    pl.exact = placement.exact and -_CW_EXACT_RANGE <= cur <= _CW_EXACT_RANGE and pl.levels <= 15
    if not pl.exact:
        return 0
    for level in range(pl.levels):
        t = placement._tk[level]
        pl.tk[level] = t
        pl.up[level] = placement._up[level]
        pl.reach[level] = placement._reach[level]
        pl.shift[level] = -1
        for k in range(62):
            if t == (<long long>1) << k:
                pl.shift[level] = k
                break
        pl.cdiv[level] = _c_floordiv(cur, t, pl.shift[level])
    return 0


@cython.cdivision(True)
cdef inline Py_ssize_t _c_place(_Place *pl, long long d, long long *expiration, Py_ssize_t *level) noexcept nogil:
    """Placement.place of deadline d (pl.exact, d within +-_CW_EXACT_RANGE): the sentinel; its
    bucket's expiration and its level through the pointers."""
    cdef Py_ssize_t l
    cdef long long v, m
    if d <= pl.cur:
        expiration[0] = pl.cur
        level[0] = _CW_DUE_LEVEL
        return pl.due
    for l in range(pl.levels):
        v = _c_floordiv(d + pl.up[l], pl.tk[l], pl.shift[l])
        if v - pl.cdiv[l] <= pl.reach[l]:
            break
    else:
        l = pl.levels - 1
        v = pl.cdiv[l] + pl.ws - 1  # clamp into the farthest bucket of the top level
    if pl.wmask >= 0:
        m = v & pl.wmask  # v % ws, rounded down as Python does
    else:
        m = v % pl.ws
        if m < 0:
            m += pl.ws
    expiration[0] = v * pl.tk[l]
    level[0] = l
    return l * pl.ws + m


cdef inline int _c_link(WheelRecords w, _Arena *a, _Place *pl, Py_ssize_t s, long long d, object corrupt) except -1:
    """TimerWheel._link of record s (its deadline d, the batch's clock): appended to the tail
    of its bucket; returns the state byte to store. Deadlines Placement.place does not take
    in 64 bits go through _link."""
    cdef long long expiration = 0
    cdef Py_ssize_t level = 0, b, bp, tail
    if not pl.exact or not -_CW_EXACT_RANGE <= d <= _CW_EXACT_RANGE:
        return w._link(s, d, pl.cur)
    b = _c_place(pl, d, &expiration, &level)
    bp = b * _CW_IW
    tail = a.i[bp + _CW_PREV]
    if tail == b:  # the bucket was empty: (re)set its expiration and queue it
        a.q[b * _CW_QW] = expiration
        if not _c_queued_at(w._queued, b, expiration):
            w._queued[b] = expiration
            _c_heap_push(w, expiration, b)
    elif not 0 <= tail < a.n:
        raise corrupt(f"bucket {b} links to {tail}, outside the records")
    a.i[s * _CW_IW + _CW_PREV] = <int>tail
    a.i[s * _CW_IW + _CW_NEXT] = <int>b
    a.i[tail * _CW_IW + _CW_NEXT] = <int>s
    a.i[bp + _CW_PREV] = <int>s
    a.by_level[level] += 1
    return (level << _CW_LEVEL_SHIFT) | _CW_SCHEDULED


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline bint _c_in_range(const long long[:] values, long long low, long long high) noexcept:
    """Every value is within [low, high]."""
    cdef Py_ssize_t j
    cdef long long v, lo, hi
    if not values.shape[0]:
        return True
    lo = hi = values[0]
    for j in range(1, values.shape[0]):
        v = values[j]
        if v < lo:
            lo = v
        if v > hi:
            hi = v
    return low <= lo and hi <= high


# ------------------------------------------------------------------ schedule_many
@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline (Py_ssize_t, Py_ssize_t, Py_ssize_t) _c_schedule_many(
        WheelRecords w, const unsigned char[::1] idents, const long long[:] deadlines, const long long[:] groups,
        const long long[:] tags, const long long[:] auxs, long long cur, const long long[::1] hashes,
        long long[::1] slots, unsigned int[::1] gens, unsigned char[::1] intent, object corrupt) except *:
    """schedule_many of distinct keys (their hashes given), inputs checked: every key looked
    up; the present ones re-armed through the batch intent (TimerWheel._rearm_many), in
    chunks of _CW_INTENT_MAX; then the absent ones added (TimerWheel._add_many) while free
    records last. Fills slots (-1: refused, arena full) and gens; returns (re-armed, added,
    refused). A column (deadlines, groups, tags, auxs) holds one value per item or one for all."""
    cdef _Arena a
    cdef _Index x
    cdef _Place pl
    cdef Py_ssize_t n = hashes.shape[0], j, jj, c, k, s, top, added = 0, refused = 0, rearms = 0
    cdef long long d
    cdef int slot32
    cdef unsigned int tag32, gen
    cdef int chunk[_CW_INTENT_MAX]
    cdef unsigned char states[_CW_INTENT_MAX]
    cdef const long long *h = &hashes[0]
    cdef const unsigned char *raw = &idents[0]
    cdef unsigned char *entries = &intent[0]
    cdef int[::1] hi = w._hi
    cdef long long *live = &w._group_live[0]
    cdef int *stack = NULL
    cdef Py_ssize_t ds = deadlines.shape[0] != 1, gs = groups.shape[0] != 1, ts = tags.shape[0] != 1
    cdef Py_ssize_t xs = auxs.shape[0] != 1
    _c_views(w, &a, &x)
    _c_place_init(&pl, w._placement, cur)
    # every key looked up first (the index cells and the records ahead prefetched)
    for j in range(n):
        _c_prefetch_probe(&x, &a, h, j, n, False)
        s = _c_find(&x, &a, h[j], groups[j * gs], raw + j * _CW_IDENT)
        slots[j] = s
        if s >= 0:
            rearms += 1
            _c_prefetch_links(&a, s)
    # re-arms, chunk by chunk: links (unlinked, then appended in batch order), the intent
    # entries, the count word (commit), the records, count 0
    j = 0
    while rearms:
        k = 0
        while j < n and k < _CW_INTENT_MAX:
            if slots[j] >= 0:
                chunk[k] = <int>j
                k += 1
            j += 1
        if not k:
            break
        for c in range(k):
            s = slots[chunk[c]]
            a.by_level[a.b[s * _CW_RB + _CW_ST] >> _CW_LEVEL_SHIFT] -= 1
            if not _c_unlink(&a, s):
                raise corrupt(f"record {s} links outside the records")
        for c in range(k):
            jj = chunk[c]
            s = slots[jj]
            d = deadlines[jj * ds]
            states[c] = <unsigned char>_c_link(w, &a, &pl, s, d, corrupt)
            slot32 = <int>s
            tag32 = <unsigned int>tags[jj * ts]
            memcpy(entries + c * _CW_INTENT_ENTRY, &slot32, 4)
            memcpy(entries + c * _CW_INTENT_ENTRY + 4, &tag32, 4)
            memcpy(entries + c * _CW_INTENT_ENTRY + 8, &d, 8)
        hi[_CW_INTENT_COUNT] = <int>k  # commit the chunk
        for c in range(k):
            jj = chunk[c]
            s = slots[jj]
            a.q[s * _CW_QW] = deadlines[jj * ds]
            a.u[s * _CW_IW + _CW_TAG] = <unsigned int>tags[jj * ts]
            a.b[s * _CW_RB + _CW_ST] = states[c]
        hi[_CW_INTENT_COUNT] = 0  # done
    # new timers, in batch order, while free records last: fields, links, state (commit)
    top = w._free_top
    if rearms < n and top:
        stack = &w._free_stack[0]
    for j in range(n):
        if slots[j] >= 0:
            continue
        if added == top:
            refused += 1
            continue
        if added + _CW_AHEAD < top:
            _pf(a.b + stack[top - 1 - added - _CW_AHEAD] * _CW_RB)
        s = stack[top - 1 - added]
        if not a.first <= s < a.n:
            raise corrupt(f"free record {s} is not an entry record")
        added += 1
        w._free_top = top - added
        gen = (a.u[s * _CW_IW + _CW_GEN] + 1) & _CW_GEN_MASK
        a.u[s * _CW_IW + _CW_GEN] = gen
        a.u[s * _CW_IW + _CW_TAG] = <unsigned int>tags[j * ts]
        a.i[s * _CW_IW + _CW_AUX] = <int>auxs[j * xs]
        a.h[s * _CW_HW + _CW_GROUP] = <unsigned short>groups[j * gs]
        a.q[s * _CW_QW] = deadlines[j * ds]
        memcpy(a.b + s * _CW_RB + _CW_KM, raw + j * _CW_IDENT, _CW_IDENT)
        a.b[s * _CW_RB + _CW_ST] = <unsigned char>_c_link(w, &a, &pl, s, deadlines[j * ds], corrupt)  # commit
        _c_index_add(&x, s, h[j])
        w._index.used += 1
        live[groups[j * gs]] += 1
        slots[j] = s
    for j in range(n):
        s = slots[j]
        if s >= 0:
            gens[j] = a.u[s * _CW_IW + _CW_GEN]
    return rearms, added, refused


# ------------------------------------------------------------------ freed records
cdef inline int _c_unlink_and_push_free(WheelRecords w, _Arena *a, Py_ssize_t *freed, Py_ssize_t k,
                                        object corrupt) except -1:
    """The end of cancel_many and release_many: unlink the k records just committed FREE
    (``freed``, in batch order) from their lists, then push them on the free stack in
    that order."""
    cdef Py_ssize_t j, top = w._free_top
    cdef int *stack = &w._free_stack[0]
    _c_unlink_freed(a, freed, k, corrupt)
    for j in range(k):
        stack[top + j] = <int>freed[j]
    w._free_top = top + k
    return 0


# ------------------------------------------------------------------ cancel_many
@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline Py_ssize_t _c_cancel_many(WheelRecords w, const unsigned char[::1] idents, const long long[:] groups,
                                      const long long[::1] hashes, unsigned char[::1] hit, object corrupt) except -1:
    """cancel_many of distinct keys (their hashes given), inputs checked: each key found is
    committed FREE and leaves the index (TimerWheel._remove_scheduled_many), then the freed
    records are unlinked and pushed on the free stack in batch order. Sets hit; returns
    how many were cancelled."""
    cdef _Arena a
    cdef _Index x
    cdef Py_ssize_t n = hashes.shape[0], j, s, k = 0
    cdef const long long *h = &hashes[0]
    cdef const unsigned char *raw = &idents[0]
    cdef long long *live = &w._group_live[0]
    cdef Py_ssize_t *freed
    cdef Py_ssize_t gs = groups.shape[0] != 1
    _c_views(w, &a, &x)
    freed = <Py_ssize_t *>malloc(n * sizeof(Py_ssize_t))
    if freed == NULL:
        raise MemoryError()
    try:
        for j in range(n):
            _c_prefetch_probe(&x, &a, h, j, n, True)
            s = _c_find(&x, &a, h[j], groups[j * gs], raw + j * _CW_IDENT)
            if s < 0:
                continue
            _c_prefetch_links(&a, s)
            a.by_level[a.b[s * _CW_RB + _CW_ST] >> _CW_LEVEL_SHIFT] -= 1
            a.b[s * _CW_RB + _CW_ST] = _CW_FREE  # commit point (the links are derived: unlinked after)
            _c_index_remove(&x, s)
            live[groups[j * gs]] -= 1
            hit[j] = 1
            freed[k] = s
            k += 1
        w._index.used -= k
        if k:
            _c_unlink_and_push_free(w, &a, freed, k, corrupt)
    finally:
        free(freed)
    return k


# ------------------------------------------------------------------ release_many
@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline Py_ssize_t _c_release_many(WheelRecords w, const long long[:] slots, const long long[:] generations,
                                       unsigned char[::1] ok, object corrupt) except -1:
    """release_many: each handle that names a FIRED record of that generation (the first
    time the batch names it) is committed FREE; then the freed records are unlinked and
    pushed on the free stack in batch order. Sets ok; returns how many were released."""
    cdef _Arena a
    cdef _Index x
    cdef Py_ssize_t n = slots.shape[0], j, s, k = 0, g, max_groups = w._group_live.shape[0]
    cdef long long *live = &w._group_live[0]
    cdef Py_ssize_t *freed
    _c_views(w, &a, &x)
    freed = <Py_ssize_t *>malloc((n if n else 1) * sizeof(Py_ssize_t))
    if freed == NULL:
        raise MemoryError()
    try:
        for j in range(n):
            if j + _CW_AHEAD < n and a.first <= slots[j + _CW_AHEAD] < a.n:
                _pf(a.b + slots[j + _CW_AHEAD] * _CW_RB)
            s = slots[j]
            if not a.first <= s < a.n:
                continue
            if a.b[s * _CW_RB + _CW_ST] != _CW_FIRED or <long long>a.u[s * _CW_IW + _CW_GEN] != generations[j]:
                continue
            g = a.h[s * _CW_HW + _CW_GROUP]
            if g >= max_groups:
                raise corrupt(f"record {s} has group id {g}, outside the group table")
            _c_prefetch_links(&a, s)
            a.b[s * _CW_RB + _CW_ST] = _CW_FREE  # commit point (a second handle of it is then stale)
            live[g] -= 1
            ok[j] = 1
            freed[k] = s
            k += 1
        if k:
            _c_unlink_and_push_free(w, &a, freed, k, corrupt)
    finally:
        free(freed)
    return k


# ------------------------------------------------------------------ records_of
@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline bint _c_records_of(WheelRecords w, const long long[:] slots, unsigned char[::1] out) except -1:
    """Copy the records at ``slots`` (a negative one counts from the end, as numpy indexes)
    into ``out``; False (nothing copied) if a slot is not a record."""
    cdef Py_ssize_t n = slots.shape[0], j, s, records = w.n_records
    cdef const unsigned char *b = &w._b[0]
    for j in range(n):
        s = slots[j]
        if s < 0:
            s += records
        if not 0 <= s < records:
            return False
    for j in range(n):
        if j + _CW_AHEAD < n:
            s = slots[j + _CW_AHEAD]
            _pf(b + (s + records if s < 0 else s) * _CW_RB)
        s = slots[j]
        if s < 0:
            s += records
        memcpy(&out[j * _CW_RB], b + s * _CW_RB, _CW_RB)
    return True


# ------------------------------------------------------------------ expire_many
@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline (Py_ssize_t, Py_ssize_t) _c_expire_many(WheelRecords w, list buckets, long long now, object new_slots,
                                                    list out, object corrupt) except *:
    """expire_many of the due buckets (TimerWheel._due_buckets, in heap order): each is
    detached (its records walked), the clock moves to ``now``; the chains of level-0
    buckets and of the due list join the fired list whole, then the due records of the
    higher-level buckets one by one, then those records are FIRED (commit points); the
    rest of the higher-level buckets is placed again (cascades), in bucket order.

    Appends the fired slots to ``out`` as an int64 array made by ``new_slots(count)``
    (none when nothing was due); returns (fired, cascaded)."""
    cdef _Arena a
    cdef _Index x
    cdef _Place pl
    cdef _Slots whole, mixed, chains, due, again
    cdef Py_ssize_t b, bp, s, t, walked = 0, level, before, ws = w._placement._ws, due_list = w.due_list
    cdef Py_ssize_t fl = w.fired_list, flp, last, j, c, fired = 0
    cdef long long *hq = &w._clock[0]
    cdef long long latest
    cdef long long[::1] dest
    cdef _Slots *into
    whole.data = mixed.data = chains.data = due.data = again.data = NULL
    whole.size = mixed.size = chains.size = due.size = again.size = 0
    whole.cap = mixed.cap = chains.cap = due.cap = again.cap = 0
    _c_views(w, &a, &x)
    try:
        # detach every due bucket, its records to whole (level 0, the due list) or mixed
        for item in buckets:
            b = item
            if not 0 <= b < a.first:
                raise corrupt(f"bucket {b} is not a sentinel")
            bp = b * _CW_IW
            s = a.i[bp + _CW_NEXT]
            if s == b:
                continue
            if b < ws or b == due_list:
                _c_push(&chains, s)
                _c_push(&chains, a.i[bp + _CW_PREV])
                into = &whole
            else:
                into = &mixed
            before = into.size
            while s != b:
                if not a.first <= s < a.n or x.pos[s] < 0:
                    raise corrupt(f"bucket {b} links to record {s}, not a scheduled entry record")
                walked += 1
                if walked > a.n:
                    raise corrupt(f"bucket {b} is not a list")
                _pf(&x.pos[s])
                _c_push(into, s)
                s = a.i[s * _CW_IW + _CW_NEXT]
                if not 0 <= s < a.n:
                    raise corrupt(f"a record of bucket {b} links to {s}, outside the records")
            level = _CW_DUE_LEVEL if b == due_list else b // ws
            a.by_level[level] -= into.size - before
            a.i[bp + _CW_PREV] = <int>b
            a.i[bp + _CW_NEXT] = <int>b
        if now > hq[_CW_CUR]:
            hq[_CW_CUR] = now  # after detaching, before re-placing (see Crash consistency)
        if not whole.size and not mixed.size:
            return 0, 0
        latest = now
        for j in range(whole.size):
            if a.q[whole.data[j] * _CW_QW] > latest:
                latest = a.q[whole.data[j] * _CW_QW]
        if latest > now:  # not in a sound arena: every record re-checked, as the mixed ones
            for j in range(mixed.size):
                _c_push(&whole, mixed.data[j])
            free(mixed.data)
            mixed = whole
            whole.data = NULL
            whole.size = whole.cap = chains.size = 0
        for j in range(mixed.size):
            s = mixed.data[j]
            if a.q[s * _CW_QW] <= now:
                _c_push(&due, s)
            else:
                _c_push(&again, s)
        fired = whole.size + due.size
        result = new_slots(fired)
        dest = result
        for j in range(whole.size):
            dest[j] = whole.data[j]
        for j in range(due.size):
            dest[whole.size + j] = due.data[j]
        # the fired records leave the index (the cells ahead prefetched)
        for j in range(fired):
            _c_prefetch_removal(&x, &dest[0], j, fired)
            if x.pos[dest[j]] < 0:  # walked twice: the lists are not sound
                raise corrupt(f"record {dest[j]} is in two lists")
            _c_index_remove(&x, dest[j])
            w._index.used -= 1
        # whole chains, then the due records of higher-level buckets, join the fired list
        flp = fl * _CW_IW
        for c in range(0, chains.size, 2):
            s = chains.data[c]
            t = chains.data[c + 1]
            last = a.i[flp + _CW_PREV]
            if not (0 <= last < a.n and 0 <= t < a.n):
                raise corrupt("the fired list or a bucket links outside the records")
            a.i[s * _CW_IW + _CW_PREV] = <int>last
            a.i[last * _CW_IW + _CW_NEXT] = <int>s
            a.i[t * _CW_IW + _CW_NEXT] = <int>fl
            a.i[flp + _CW_PREV] = <int>t
        if due.size:
            last = a.i[flp + _CW_PREV]
            if not 0 <= last < a.n:
                raise corrupt("the fired list links outside the records")
            a.i[last * _CW_IW + _CW_NEXT] = <int>due.data[0]
            for j in range(due.size):
                s = due.data[j]
                a.i[s * _CW_IW + _CW_PREV] = <int>last
                a.i[s * _CW_IW + _CW_NEXT] = <int>(due.data[j + 1] if j + 1 < due.size else fl)
                last = s
            a.i[flp + _CW_PREV] = <int>last
        for j in range(fired):
            a.b[dest[j] * _CW_RB + _CW_ST] = _CW_FIRED  # commit points
        # the rest cascades: placed again relative to the new clock
        _c_place_init(&pl, w._placement, hq[_CW_CUR])
        for j in range(again.size):
            s = again.data[j]
            a.b[s * _CW_RB + _CW_ST] = <unsigned char>_c_link(w, &a, &pl, s, a.q[s * _CW_QW], corrupt)
        out.append(result)
        return fired, again.size
    finally:
        free(whole.data)
        free(mixed.data)
        free(chains.data)
        free(due.data)
        free(again.data)
