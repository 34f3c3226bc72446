/* The protocol floor's rank turn with its I/O, framing and packing in C: bench tooling.
 *
 * `python -m benchmarks.bench --floor` runs this beside the Python floor (floor.py) to measure
 * what a rank's turn costs when no Python runs between the wake-up and the write but the
 * request's decoding and the report's arguments (the `answer` callback, in Python, as in
 * the floor). One call is one turn:
 *
 *   1. wait for one whole reply on the socket (the XREADGROUP sent with the last write);
 *   2. for each entry, call answer(entry_id, m) -> None or the report's command (a tuple);
 *   3. write the XACK of every entry, the commands, then `read` (the next XREADGROUP) at once;
 *   4. read the XACK's and the commands' replies (their values are not looked at), leave the
 *      read's for the next turn, and return the number of entries.
 *
 * Bytes read past a reply stay in `pending` (a bytearray the caller keeps between turns),
 * so the module holds no state. RESP2 only; no TLS. Nothing here is safe to deploy: like
 * the Python floor, an error reply is not noticed, and a lost reply raises
 * ConnectionError or TimeoutError and ends the rank.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

#define MAX_ENTRIES 1024
#define RECV_CHUNK 65536

/* --- framing ------------------------------------------------------------------------ */

/* The end of the RESP value at p, NULL if [p, end) does not hold all of it yet, or
 * `bad` set if it is not RESP2. */
static const char *value_end(const char *p, const char *end, int *bad) {
    if (p >= end) return NULL;
    const char *nl = memchr(p, '\n', end - p);
    if (nl == NULL) return NULL;
    long n = strtol(p + 1, NULL, 10);
    const char *q = nl + 1;
    switch (*p) {
    case '+': case '-': case ':':
        return q;
    case '$':
        if (n < 0) return q;
        return (end - q >= n + 2) ? q + n + 2 : NULL;
    case '*':
        for (long i = 0; i < n && q != NULL; i++) q = value_end(q, end, bad);
        return q;
    default:
        *bad = 1;
        return NULL;
    }
}

/* Read the header of a framed (complete) value at p: its count or length, and what
 * follows the header. */
static const char *header(const char *p, long *n) {
    const char *nl = strchr(p, '\n');
    *n = strtol(p + 1, NULL, 10);
    return nl + 1;
}

/* A framed bulk string at p: its bytes in s, n; returns what follows it. */
static const char *bulk(const char *p, const char **s, long *n) {
    const char *q = header(p, n);
    *s = q;
    return *n < 0 ? q : q + *n + 2;
}

/* --- the socket ----------------------------------------------------------------------- */

/* Wait until `pending` starts with a whole reply; returns its length, or -1 with an
 * exception set (TimeoutError after timeout_ms without a byte, ConnectionError on EOF or
 * a reset, ValueError on bytes that are not RESP2). */
static Py_ssize_t next_reply(int fd, PyObject *pending, int timeout_ms) {
    for (;;) {
        const char *start = PyByteArray_AS_STRING(pending);
        Py_ssize_t len = PyByteArray_GET_SIZE(pending);
        int bad = 0;
        const char *end = value_end(start, start + len, &bad);
        if (end != NULL) return end - start;
        if (bad) {
            PyErr_SetString(PyExc_ValueError, "the server's reply is not RESP2");
            return -1;
        }
        if (PyByteArray_Resize(pending, len + RECV_CHUNK) < 0) return -1;
        char *into = PyByteArray_AS_STRING(pending) + len;
        struct pollfd pfd = {fd, POLLIN, 0};
        int ready;
        ssize_t got = -1;
        int err = 0;
        Py_BEGIN_ALLOW_THREADS
        ready = poll(&pfd, 1, timeout_ms);
        if (ready > 0) got = recv(fd, into, RECV_CHUNK, 0);
        err = errno;
        Py_END_ALLOW_THREADS
        if (PyByteArray_Resize(pending, len + (got > 0 ? got : 0)) < 0) return -1;
        if (ready == 0) {
            PyErr_Format(PyExc_TimeoutError, "no reply within %d ms", timeout_ms);
            return -1;
        }
        if (got == 0) {
            PyErr_SetString(PyExc_ConnectionError, "the server closed the connection");
            return -1;
        }
        if (got < 0) {
            if (err == EINTR) {
                if (PyErr_CheckSignals() < 0) return -1; /* a handler raised */
                continue;
            }
            errno = err;
            PyErr_SetFromErrno(PyExc_ConnectionError);
            return -1;
        }
    }
}

static int drop_front(PyObject *pending, Py_ssize_t n) {
    char *start = PyByteArray_AS_STRING(pending);
    Py_ssize_t len = PyByteArray_GET_SIZE(pending);
    memmove(start, start + n, len - n);
    return PyByteArray_Resize(pending, len - n);
}

static int send_all(int fd, const char *data, Py_ssize_t len) {
    Py_ssize_t off = 0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    while (off < len) {
        ssize_t w = send(fd, data + off, len - off, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            err = errno ? errno : EPIPE;
            break;
        }
        off += w;
    }
    Py_END_ALLOW_THREADS
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_ConnectionError);
        return -1;
    }
    return 0;
}

/* --- packing -------------------------------------------------------------------------- */

static int put(PyObject *out, const char *s, Py_ssize_t n) {
    Py_ssize_t len = PyByteArray_GET_SIZE(out);
    if (PyByteArray_Resize(out, len + n) < 0) return -1;
    memcpy(PyByteArray_AS_STRING(out) + len, s, n);
    return 0;
}

static int put_header(PyObject *out, char kind, Py_ssize_t n) {
    char text[32];
    int k = snprintf(text, sizeof text, "%c%zd\r\n", kind, n);
    return put(out, text, k);
}

static int put_arg(PyObject *out, const char *s, Py_ssize_t n) {
    if (put_header(out, '$', n) < 0 || put(out, s, n) < 0) return -1;
    return put(out, "\r\n", 2);
}

/* One argument of a command the callback made: bytes, str or int. */
static int put_object(PyObject *out, PyObject *arg) {
    if (PyBytes_Check(arg)) return put_arg(out, PyBytes_AS_STRING(arg), PyBytes_GET_SIZE(arg));
    if (PyUnicode_Check(arg)) {
        Py_ssize_t n;
        const char *s = PyUnicode_AsUTF8AndSize(arg, &n);
        return s == NULL ? -1 : put_arg(out, s, n);
    }
    if (PyLong_Check(arg)) {
        long long v = PyLong_AsLongLong(arg);
        if (v == -1 && PyErr_Occurred()) return -1;
        char text[32];
        int k = snprintf(text, sizeof text, "%lld", v);
        return put_arg(out, text, k);
    }
    PyErr_Format(PyExc_TypeError, "a command argument must be bytes, str or int, not %R", arg);
    return -1;
}

static int put_command(PyObject *out, PyObject *command) {
    if (!PyTuple_Check(command)) {
        PyErr_Format(PyExc_TypeError, "answer() must return a tuple or None, not %R", command);
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(command);
    if (put_header(out, '*', n) < 0) return -1;
    for (Py_ssize_t i = 0; i < n; i++)
        if (put_object(out, PyTuple_GET_ITEM(command, i)) < 0) return -1;
    return 0;
}

/* --- the turn ------------------------------------------------------------------------- */

typedef struct {
    const char *id, *m; /* m is NULL where the entry has no `m` field (or no fields) */
    long id_len, m_len;
} Entry;

/* The entries of a framed XREADGROUP reply (nil: none); returns their count. */
static long entries_of(const char *p, Entry *entries) {
    long n, count = 0, streams, name_len;
    const char *name;
    if (p[0] != '*' || p[1] == '-') return 0;
    p = header(p, &streams);
    if (streams < 1) return 0;
    p = header(p, &n); /* [name, entries] */
    p = bulk(p, &name, &name_len);
    p = header(p, &count);
    if (count > MAX_ENTRIES) count = MAX_ENTRIES; /* COUNT is below this */
    for (long i = 0; i < count; i++) {
        long fields;
        Entry *e = &entries[i];
        p = header(p, &n); /* [id, fields] */
        p = bulk(p, &e->id, &e->id_len);
        p = header(p, &fields);
        e->m = NULL;
        for (long j = 0; j + 1 < fields; j += 2) {
            const char *k, *v;
            long kn, vn;
            p = bulk(p, &k, &kn);
            p = bulk(p, &v, &vn);
            if (kn == 1 && k[0] == 'm' && vn >= 0) {
                e->m = v;
                e->m_len = vn;
            }
        }
    }
    return count;
}

/* Pack the XACK and each entry's report into out; returns the commands packed, or -1. */
static long pack_answers(PyObject *out, PyObject *ack_head, PyObject *answer,
                         Entry *entries, long count) {
    if (count == 0) return 0;
    Py_ssize_t head = PyTuple_GET_SIZE(ack_head);
    if (put_header(out, '*', head + count) < 0) return -1;
    for (Py_ssize_t i = 0; i < head; i++)
        if (put_object(out, PyTuple_GET_ITEM(ack_head, i)) < 0) return -1;
    for (long i = 0; i < count; i++)
        if (put_arg(out, entries[i].id, entries[i].id_len) < 0) return -1;
    long commands = 1;
    for (long i = 0; i < count; i++) {
        if (entries[i].m == NULL) continue;
        PyObject *command = PyObject_CallFunction(
            answer, "y#y#", entries[i].id, (Py_ssize_t)entries[i].id_len,
            entries[i].m, (Py_ssize_t)entries[i].m_len);
        if (command == NULL) return -1;
        int rc = command == Py_None ? 0 : put_command(out, command);
        commands += command != Py_None;
        Py_DECREF(command);
        if (rc < 0) return -1;
    }
    return commands;
}

static PyObject *turn(PyObject *Py_UNUSED(self), PyObject *args) {
    int fd, timeout_ms;
    PyObject *pending, *read, *ack_head, *answer;
    if (!PyArg_ParseTuple(args, "iiO!O!O!O:turn", &fd, &timeout_ms, &PyByteArray_Type,
                          &pending, &PyBytes_Type, &read, &PyTuple_Type, &ack_head, &answer))
        return NULL;
    Py_ssize_t size = next_reply(fd, pending, timeout_ms);
    if (size < 0) return NULL;
    static Entry entries[MAX_ENTRIES]; /* one turn thread per process: the floor's ranks */
    long count = entries_of(PyByteArray_AS_STRING(pending), entries);
    PyObject *out = PyByteArray_FromStringAndSize(NULL, 0);
    if (out == NULL) return NULL;
    long commands = pack_answers(out, ack_head, answer, entries, count);
    int failed = commands < 0 || drop_front(pending, size) < 0 ||
                 put(out, PyBytes_AS_STRING(read), PyBytes_GET_SIZE(read)) < 0 ||
                 send_all(fd, PyByteArray_AS_STRING(out), PyByteArray_GET_SIZE(out)) < 0;
    Py_DECREF(out);
    for (long i = 0; !failed && i < commands; i++) {
        size = next_reply(fd, pending, timeout_ms);
        failed = size < 0 || drop_front(pending, size) < 0;
    }
    return failed ? NULL : PyLong_FromLong(count);
}

static PyMethodDef methods[] = {
    {"turn", turn, METH_VARARGS,
     "turn(fd, timeout_ms, pending, read, ack_head, answer) -> entries: one rank turn."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native_floor",
    "The protocol floor's rank turn in C (bench tooling).", -1, methods,
};

PyMODINIT_FUNC PyInit__native_floor(void) { return PyModule_Create(&module); }
