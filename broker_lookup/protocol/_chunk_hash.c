/*
 * broker_lookup.protocol._chunk_hash: LMCache's builtin-hash chunk chain, in C.
 *
 * For the builtin hash, ChunkedTokenHasher._chain computes, per chunk of tokens,
 *
 *     chain = hash((chain, tuple(chunk), ()))
 *
 * starting from NONE_HASH. This module computes the very same ints without building a
 * tuple or an int object per token: it reproduces CPython's tuple hash (the xxHash-based
 * tuplehash of Objects/tupleobject.c, as of CPython 3.8) and int hash
 * (long_hash: |v| mod 2**61 - 1, sign restored, -1 becomes -2) for 64-bit Py_hash_t.
 *
 * The inner tuple hashes of different chunks do not depend on each other, only the outer
 * 3-tuple chains, so the inner hashes of LANES chunks are computed interleaved: their
 * multiply chains then overlap in the CPU instead of waiting on each other.
 *
 * Python checks this module against its own path at import (hashing.py) and falls back
 * when they disagree, when this module is missing, or when chain() raises TypeError.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if SIZEOF_PY_HASH_T != 8
#error "_chunk_hash reproduces the 64-bit Py_hash_t tuple hash only"
#endif

/* Objects/tupleobject.c (64-bit) */
#define XXPRIME_1 ((uint64_t)11400714785074694791ULL)
#define XXPRIME_2 ((uint64_t)14029467366897019727ULL)
#define XXPRIME_5 ((uint64_t)2870177450012600261ULL)
#define XXROTATE(x) (((x) << 31) | ((x) >> 33))

/* Python/pyhash.h: _PyHASH_MODULUS for 64-bit hashes */
#define HASH_BITS 61
#define HASH_MODULUS (((uint64_t)1 << HASH_BITS) - 1)

/* Chunks whose inner tuple hashes are computed together (4 measured best on x86-64). */
#define LANES 4

#if defined(__GNUC__) || defined(__clang__)
#define LIKELY(x) __builtin_expect(!!(x), 1)
#else
#define LIKELY(x) (x)
#endif

/*
 * Buffers of at least this many tokens are hashed with the GIL released. Below, the
 * hashing takes about a microsecond, less than handing the GIL over can cost when
 * another thread is waiting for it (it may keep it for a switch interval).
 */
#define GIL_FREE_MIN_TOKENS 4096

/* One item of a tuple hash: acc += lane * P2; acc = rotl(acc, 31); acc *= P1. */
#define STEP(acc, lane)                       \
    do {                                      \
        (acc) += (uint64_t)(lane) * XXPRIME_2; \
        (acc) = XXROTATE(acc);                \
        (acc) *= XXPRIME_1;                   \
    } while (0)

/* The end of tuplehash: add the length, mangled to keep hash(()) historical. */
static inline uint64_t
tuple_finish(uint64_t acc, Py_ssize_t len)
{
    acc += (uint64_t)len ^ (XXPRIME_5 ^ 3527539ULL);
    if (acc == (uint64_t)-1) {
        return 1546275796;
    }
    return acc;
}

/* Values below 2**61 - 1 in magnitude hash to themselves (but -1 is -2). */
static inline uint64_t
lane_small_signed(int64_t v)
{
    return (uint64_t)(v == -1 ? -2 : v);
}

/* long_hash of an unsigned 64-bit value: u mod 2**61 - 1 (never -1). */
static inline uint64_t
lane_u64(uint64_t u)
{
    if (LIKELY(u < HASH_MODULUS)) { /* token ids: the value itself */
        return u;
    }
    uint64_t r = (u & HASH_MODULUS) + (u >> HASH_BITS); /* < 2 * modulus */
    return r >= HASH_MODULUS ? r - HASH_MODULUS : r;
}

/* long_hash of a signed 64-bit value: |v| mod 2**61 - 1, sign restored, -1 -> -2. */
static inline uint64_t
lane_i64(int64_t v)
{
    /* -modulus < v < modulus (token ids): the value itself; a branch that is always taken
     * for token ids costs far less than the reduction. */
    if (LIKELY((uint64_t)v + (HASH_MODULUS - 1) < 2 * HASH_MODULUS - 1)) {
        return lane_small_signed(v);
    }
    uint64_t magnitude = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    int64_t r = (int64_t)lane_u64(magnitude);
    if (v < 0) {
        r = r == 1 ? -2 : -r;
    }
    return (uint64_t)r;
}

static inline uint64_t
lane_small_unsigned(uint64_t v)
{
    return v;
}

/* A lane already computed (the hash of a list item). */
static inline uint64_t
lane_identity(uint64_t v)
{
    return v;
}

/*
 * inner_T(base, stride, size, end, out): the tuple hash of each chunk of ``size`` items in
 * items [0, end) (the last one shorter when ``end % size``) into out[0 .. ceil(end/size)).
 * Item i is the T at base + i * stride (bytes; any alignment). Needs no GIL.
 */
#define DEFINE_INNER(NAME, T, LANE)                                                     \
    static void NAME(const char *base, Py_ssize_t stride, Py_ssize_t size,              \
                     Py_ssize_t end, uint64_t *out)                                     \
    {                                                                                   \
        const Py_ssize_t n_full = end / size;                                           \
        const Py_ssize_t tail = end % size;                                             \
        const Py_ssize_t chunk_bytes = n_full ? size * stride : 0;                      \
        Py_ssize_t c = 0;                                                               \
        for (; c + LANES <= n_full; c += LANES) {                                       \
            const char *p0 = base + c * chunk_bytes;                                    \
            const char *p1 = p0 + chunk_bytes;                                          \
            const char *p2 = p1 + chunk_bytes;                                          \
            const char *p3 = p2 + chunk_bytes;                                          \
            uint64_t a0 = XXPRIME_5, a1 = XXPRIME_5, a2 = XXPRIME_5, a3 = XXPRIME_5;    \
            for (Py_ssize_t j = 0; j < size; j++) {                                     \
                T v0, v1, v2, v3;                                                       \
                memcpy(&v0, p0, sizeof(T));                                             \
                memcpy(&v1, p1, sizeof(T));                                             \
                memcpy(&v2, p2, sizeof(T));                                             \
                memcpy(&v3, p3, sizeof(T));                                             \
                STEP(a0, LANE(v0));                                                     \
                STEP(a1, LANE(v1));                                                     \
                STEP(a2, LANE(v2));                                                     \
                STEP(a3, LANE(v3));                                                     \
                p0 += stride;                                                           \
                p1 += stride;                                                           \
                p2 += stride;                                                           \
                p3 += stride;                                                           \
            }                                                                           \
            out[c] = tuple_finish(a0, size);                                            \
            out[c + 1] = tuple_finish(a1, size);                                        \
            out[c + 2] = tuple_finish(a2, size);                                        \
            out[c + 3] = tuple_finish(a3, size);                                        \
        }                                                                               \
        for (; c <= n_full; c++) { /* the last full chunks one by one, then the tail */ \
            const Py_ssize_t len = c < n_full ? size : tail;                            \
            if (len == 0) {                                                             \
                break;                                                                  \
            }                                                                           \
            const char *p = base + c * chunk_bytes;                                     \
            uint64_t acc = XXPRIME_5;                                                   \
            for (Py_ssize_t j = 0; j < len; j++) {                                      \
                T v;                                                                    \
                memcpy(&v, p, sizeof(T));                                               \
                STEP(acc, LANE(v));                                                     \
                p += stride;                                                            \
            }                                                                           \
            out[c] = tuple_finish(acc, len);                                            \
        }                                                                               \
    }

DEFINE_INNER(inner_i8, int8_t, lane_small_signed)
DEFINE_INNER(inner_u8, uint8_t, lane_small_unsigned)
DEFINE_INNER(inner_i16, int16_t, lane_small_signed)
DEFINE_INNER(inner_u16, uint16_t, lane_small_unsigned)
DEFINE_INNER(inner_i32, int32_t, lane_small_signed)
DEFINE_INNER(inner_u32, uint32_t, lane_small_unsigned)
DEFINE_INNER(inner_i64, int64_t, lane_i64)
DEFINE_INNER(inner_u64, uint64_t, lane_u64)
DEFINE_INNER(inner_lanes, uint64_t, lane_identity)

typedef void (*inner_fn)(const char *, Py_ssize_t, Py_ssize_t, Py_ssize_t, uint64_t *);

/*
 * The kernel for a buffer's format, or NULL (TypeError: Python hashes it instead).
 * Integer codes only, native byte order; the width comes from itemsize.
 */
static inline inner_fn
kernel_for_format(const char *format, Py_ssize_t itemsize)
{
    if (format == NULL) {
        format = "B"; /* PEP 3118: no format means unsigned bytes */
    }
    if (format[0] == '@' || format[0] == '=') {
        format++;
    }
#if PY_LITTLE_ENDIAN
    else if (format[0] == '<') {
        format++;
    }
#else
    else if (format[0] == '>' || format[0] == '!') {
        format++;
    }
#endif
    if (format[0] == '\0' || format[1] != '\0') {
        return NULL;
    }
    int is_signed;
    switch (format[0]) {
    case 'b': case 'h': case 'i': case 'l': case 'q': case 'n':
        is_signed = 1;
        break;
    case 'B': case 'H': case 'I': case 'L': case 'Q': case 'N':
        is_signed = 0;
        break;
    default: /* bool, char, floats, pointers, structs */
        return NULL;
    }
    switch (itemsize) {
    case 1:
        return is_signed ? inner_i8 : inner_u8;
    case 2:
        return is_signed ? inner_i16 : inner_u16;
    case 4:
        return is_signed ? inner_i32 : inner_u32;
    case 8:
        return is_signed ? inner_i64 : inner_u64;
    default:
        return NULL;
    }
}

/*
 * The outer chain: chain_c = hash((chain_{c-1}, inner_c, ())) as a list of ints. The
 * first lane is hash(NONE_HASH) from Python (NONE_HASH may be any int); later ones are
 * the int hash of the previous chain value.
 */
static PyObject *
outer_chain(const uint64_t *inner, Py_ssize_t n_chunks, int64_t first_lane, int64_t empty_lane)
{
    PyObject *out = PyList_New(n_chunks);
    if (out == NULL) {
        return NULL;
    }
    uint64_t lane = (uint64_t)first_lane;
    for (Py_ssize_t c = 0; c < n_chunks; c++) {
        uint64_t acc = XXPRIME_5;
        STEP(acc, lane);
        STEP(acc, inner[c]);
        STEP(acc, (uint64_t)empty_lane);
        int64_t chain = (int64_t)tuple_finish(acc, 3);
        PyObject *item = PyLong_FromLongLong(chain);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, c, item);
        lane = lane_i64(chain);
    }
    return out;
}

/* Inner hashes of a contiguous or strided 1-D integer buffer: 1 done, 0 not a fit, -1 error. */
static int
inner_from_buffer(PyObject *tokens, Py_ssize_t size, Py_ssize_t end, uint64_t **inner,
                  Py_ssize_t n_chunks)
{
    Py_buffer view;
    if (PyObject_GetBuffer(tokens, &view, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return 0;
    }
    inner_fn kernel = NULL;
    if (view.ndim == 1 && view.suboffsets == NULL) {
        kernel = kernel_for_format(view.format, view.itemsize);
    }
    if (kernel == NULL) {
        PyBuffer_Release(&view);
        return 0;
    }
    if (end > view.shape[0]) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "end=%zd is past the %zd tokens", end, view.shape[0]);
        return -1;
    }
    Py_ssize_t stride = view.strides != NULL ? view.strides[0] : view.itemsize;
    *inner = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n_chunks ? n_chunks : 1));
    if (*inner == NULL) {
        PyBuffer_Release(&view);
        PyErr_NoMemory();
        return -1;
    }
    if (end >= GIL_FREE_MIN_TOKENS) {
        Py_BEGIN_ALLOW_THREADS
        kernel((const char *)view.buf, stride, size, end, *inner);
        Py_END_ALLOW_THREADS
    }
    else {
        kernel((const char *)view.buf, stride, size, end, *inner);
    }
    PyBuffer_Release(&view);
    return 1;
}

/*
 * The int hash of a small exact int (at most one 30-bit digit, as token ids are) into
 * *hash, without a call, a reference or any write to the int: 1 done, 0 not one.
 * This reads 3.11's int layout, so other versions take PyObject_Hash.
 */
static inline int
small_int_hash(PyObject *item, Py_hash_t *hash)
{
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
    if (PyLong_CheckExact(item)) {
        Py_ssize_t digits = Py_SIZE(item); /* signed: the sign of the value */
        if (digits == 0) {
            *hash = 0;
            return 1;
        }
        if (digits == 1) {
            *hash = (Py_hash_t)((PyLongObject *)item)->ob_digit[0];
            return 1;
        }
        if (digits == -1) {
            Py_hash_t h = -(Py_hash_t)((PyLongObject *)item)->ob_digit[0];
            *hash = h == -1 ? -2 : h;
            return 1;
        }
    }
#else
    (void)item;
    (void)hash;
#endif
    return 0;
}

/*
 * Inner hashes of a sequence's items, exactly as tuple(chunk) would hash them (any
 * hashable item). The item hashes of LANES chunks go to a buffer, then the same
 * interleaved kernel as for integer buffers hashes them. -1 on error.
 */
static int
inner_from_sequence(PyObject *fast, Py_ssize_t size, Py_ssize_t end, uint64_t *inner)
{
    /* LANES chunks at a time (whole chunks: a block ends on a chunk boundary). */
    Py_ssize_t block = size > end / LANES ? end : LANES * size;
    uint64_t *lanes = PyMem_Malloc(sizeof(uint64_t) * (size_t)(block ? block : 1));
    if (lanes == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t start = 0; start < end; start += block) {
        Py_ssize_t stop = end - start < block ? end : start + block;
        for (Py_ssize_t i = start; i < stop; i++) {
            /* An item's __hash__ may run Python code that shrinks the sequence. */
            if (i >= PySequence_Fast_GET_SIZE(fast)) {
                PyMem_Free(lanes);
                PyErr_SetString(PyExc_RuntimeError, "tokens changed size while hashed");
                return -1;
            }
            PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
            Py_hash_t h;
            if (!small_int_hash(item, &h)) {
                Py_INCREF(item); /* its __hash__ may drop the sequence's reference */
                h = PyObject_Hash(item);
                Py_DECREF(item);
                if (h == -1) {
                    PyMem_Free(lanes);
                    return -1;
                }
            }
            lanes[i - start] = (uint64_t)h;
        }
        inner_lanes((const char *)lanes, sizeof(uint64_t), size, stop - start,
                    inner + start / size);
    }
    PyMem_Free(lanes);
    return 0;
}

PyDoc_STRVAR(chain_doc,
"chain(tokens, chunk_size, end, first_lane, empty_lane) -> list[int]\n"
"\n"
"hash((chain, tuple(chunk), ())) per chunk of chunk_size tokens of tokens[:end] (the\n"
"last chunk shorter when end % chunk_size), chained from the value whose hash is\n"
"first_lane; empty_lane is hash(()). tokens: a list, tuple or other sequence, or a\n"
"1-D buffer of 8/16/32/64-bit integers (hashed without the GIL). TypeError for any\n"
"other input, so that the caller can hash it in Python.");

static PyObject *
chunk_hash_chain(PyObject *module, PyObject *args)
{
    PyObject *tokens;
    Py_ssize_t size, end;
    long long first_lane, empty_lane;
    (void)module;
    if (!PyArg_ParseTuple(args, "OnnLL:chain", &tokens, &size, &end, &first_lane,
                          &empty_lane)) {
        return NULL;
    }
    if (size <= 0) {
        PyErr_Format(PyExc_ValueError, "chunk_size=%zd: must be positive", size);
        return NULL;
    }
    if (end < 0) {
        PyErr_Format(PyExc_ValueError, "end=%zd: must not be negative", end);
        return NULL;
    }
    Py_ssize_t n_chunks = end / size + (end % size ? 1 : 0);
    uint64_t *inner = NULL;
    PyObject *result = NULL;

    if (!PyList_Check(tokens) && !PyTuple_Check(tokens)) {
        int done = inner_from_buffer(tokens, size, end, &inner, n_chunks);
        if (done < 0) {
            return NULL;
        }
        if (done) {
            result = outer_chain(inner, n_chunks, first_lane, empty_lane);
            PyMem_Free(inner);
            return result;
        }
        if (PyObject_CheckBuffer(tokens) || !PySequence_Check(tokens)) {
            return PyErr_Format(PyExc_TypeError, "cannot hash %.200s tokens natively",
                                Py_TYPE(tokens)->tp_name);
        }
    }
    PyObject *fast = PySequence_Fast(tokens, "tokens must be a sequence");
    if (fast == NULL) {
        return NULL;
    }
    if (end > PySequence_Fast_GET_SIZE(fast)) {
        PyErr_Format(PyExc_ValueError, "end=%zd is past the %zd tokens", end,
                     PySequence_Fast_GET_SIZE(fast));
        Py_DECREF(fast);
        return NULL;
    }
    inner = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n_chunks ? n_chunks : 1));
    if (inner == NULL) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    if (inner_from_sequence(fast, size, end, inner) == 0) {
        result = outer_chain(inner, n_chunks, first_lane, empty_lane);
    }
    PyMem_Free(inner);
    Py_DECREF(fast);
    return result;
}

static PyMethodDef chunk_hash_methods[] = {
    {"chain", chunk_hash_chain, METH_VARARGS, chain_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef chunk_hash_module = {
    PyModuleDef_HEAD_INIT,
    "broker_lookup.protocol._chunk_hash",
    "LMCache's builtin-hash chunk chain in C (see broker_lookup.protocol.hashing).",
    0,
    chunk_hash_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__chunk_hash(void)
{
    return PyModuleDef_Init(&chunk_hash_module);
}
