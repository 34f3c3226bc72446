/*
 * workers.pipeline._scan: the rank's common batch read in one C call.
 *
 * Reader.parse turns an XREADGROUP reply into the lookups to serve, each with the ms it
 * stays worth answering, and the ids to ack. Inside a rank every Python step of that
 * (the entries' walk, decoding, validation, the budget against the server's clock) runs
 * on cold caches after a blocking read and costs several times its tight-loop price, so
 * the common batch is done here at once:
 *
 *     scan(reply, decode, lookup_type, now_ms, max_chunks, max_id_length, world_size)
 *         -> (messages, ack_ids) | None
 *
 * It answers only for a batch that the Python path would serve in full, and gives the
 * same result: every entry a LookupRequest (`decode(m)` of exactly `lookup_type`) that
 * passes entry_problem, with a positive budget and a stamped id. For anything else (an
 * abort or a keep, a malformed or invalid entry, an id that is not ASCII, request_configs
 * set, an older client's entry without a budget, a value past 64 bits) it returns None
 * and the Python path reads the batch: what it rejects is rejected there, with its
 * reason, so this file holds no reasons and no second set of rules to keep in step
 * beyond "accept only what Python accepts" (tests/unit/test_scan_equivalence.py).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

static PyObject *s_lookup_id, *s_hashes, *s_offsets, *s_expected, *s_tokens,
    *s_budget_ms, *s_request_configs;

/* -- a field of the decoded request ------------------------------------------------- */

/* The attribute `name` of msg if it is exactly a list, else NULL (no error set). */
static PyObject *list_field(PyObject *msg, PyObject *name) {
    PyObject *value = PyObject_GetAttr(msg, name);
    if (value == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (!PyList_CheckExact(value)) {
        Py_DECREF(value);
        return NULL;
    }
    return value;
}

/* The attribute `name` of msg as a C long long in *out; 0 if it is not an int that fits. */
static int int_field(PyObject *msg, PyObject *name, long long *out) {
    PyObject *value = PyObject_GetAttr(msg, name);
    if (value == NULL) {
        PyErr_Clear();
        return 0;
    }
    int overflow = 0;
    *out = PyLong_CheckExact(value) ? PyLong_AsLongLongAndOverflow(value, &overflow) : -1;
    int ok = PyLong_CheckExact(value) && !overflow && !(*out == -1 && PyErr_Occurred());
    PyErr_Clear();
    Py_DECREF(value);
    return ok;
}

/* -- the checks: each says "served as Python would", or "ask Python" ---------------- */

/* Each item an int within [lo, hi]; their sum in *sum when sum is not NULL. */
static int ints_within(PyObject *list, long long lo, long long hi, long long *sum) {
    long long total = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
        PyObject *item = PyList_GET_ITEM(list, i);
        int overflow = 0;
        long long v = PyLong_CheckExact(item) ? PyLong_AsLongLongAndOverflow(item, &overflow) : 0;
        if (!PyLong_CheckExact(item) || overflow || (v == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return 0;
        }
        if (v < lo || v > hi) return 0;
        if (sum != NULL && __builtin_add_overflow(total, v, &total)) return 0;
    }
    if (sum != NULL) *sum = total;
    return 1;
}

/* Hashes in the 64-bit range: int64, or uint64 above it. */
static int hashes_ok(PyObject *hashes) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(hashes); i++) {
        PyObject *item = PyList_GET_ITEM(hashes, i);
        if (!PyLong_CheckExact(item)) return 0;
        int overflow = 0;
        PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow < 0) return 0;
        if (overflow > 0) {
            PyLong_AsUnsignedLongLong(item);
            if (PyErr_Occurred()) {
                PyErr_Clear();
                return 0;
            }
        }
    }
    return 1;
}

typedef struct {
    Py_ssize_t max_chunks, max_id_length;
    long long world_size; /* < 0: not known, no bound */
} Limits;

/* Whether entry_problem(msg) is None for certain, and the request's budget in *budget. */
static int served(PyObject *msg, const Limits *limits, long long *budget) {
    int ok = 0;
    long long tokens, offsets_sum;
    PyObject *id = PyObject_GetAttr(msg, s_lookup_id);
    PyObject *configs = PyObject_GetAttr(msg, s_request_configs);
    PyObject *hashes = list_field(msg, s_hashes);
    PyObject *offsets = list_field(msg, s_offsets);
    PyObject *expected = list_field(msg, s_expected);
    PyErr_Clear();
    if (id == NULL || !PyUnicode_CheckExact(id) || !PyUnicode_IS_ASCII(id)) goto done;
    if (PyUnicode_GET_LENGTH(id) < 1 || PyUnicode_GET_LENGTH(id) > limits->max_id_length)
        goto done;
    if (configs != Py_None) goto done; /* JSON-size rule: Python's */
    if (hashes == NULL || offsets == NULL || expected == NULL) goto done;
    Py_ssize_t chunks = PyList_GET_SIZE(hashes);
    if (chunks != PyList_GET_SIZE(offsets) || chunks < 1 || chunks > limits->max_chunks)
        goto done;
    if (!ints_within(offsets, 1, LLONG_MAX, &offsets_sum) || !hashes_ok(hashes)) goto done;
    long long top = limits->world_size < 0 ? LLONG_MAX : limits->world_size - 1;
    if (PyList_GET_SIZE(expected) < 1 || !ints_within(expected, 0, top, NULL)) goto done;
    if (!int_field(msg, s_tokens, &tokens) || tokens != offsets_sum) goto done;
    /* budget 0 (an older client) is judged by its wall-clock deadline: Python's. */
    ok = int_field(msg, s_budget_ms, budget) && *budget > 0;
done:
    Py_XDECREF(id);
    Py_XDECREF(configs);
    Py_XDECREF(hashes);
    Py_XDECREF(offsets);
    Py_XDECREF(expected);
    return ok;
}

/* The server's ms in an entry id "<ms>-<seq>" (ASCII digits before the dash); -1 if none. */
static long long stamp_ms(PyObject *entry_id) {
    const char *s = PyBytes_AS_STRING(entry_id);
    Py_ssize_t n = PyBytes_GET_SIZE(entry_id);
    long long ms = 0;
    Py_ssize_t i = 0;
    for (; i < n && s[i] != '-'; i++) {
        if (s[i] < '0' || s[i] > '9' || ms > (LLONG_MAX - 9) / 10) return -1;
        ms = ms * 10 + (s[i] - '0');
    }
    return i == 0 ? -1 : ms;
}

/* -- the reply --------------------------------------------------------------------- */

/* The m field of a raw entry's flat field list ([f1, v1, ...]), borrowed; NULL if none. */
static PyObject *m_field(PyObject *fields) {
    if (!PyList_CheckExact(fields) || PyList_GET_SIZE(fields) % 2) return NULL;
    PyObject *m = NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(fields); i += 2) {
        PyObject *key = PyList_GET_ITEM(fields, i);
        if (PyBytes_CheckExact(key) && PyBytes_GET_SIZE(key) == 1 &&
            PyBytes_AS_STRING(key)[0] == 'm')
            m = PyList_GET_ITEM(fields, i + 1); /* the last one wins, as dict(pairs) */
    }
    return m != NULL && PyBytes_CheckExact(m) ? m : NULL;
}

/* The one stream's entry list of a raw XREADGROUP reply, borrowed; NULL if not that:
 * RESP2 gives [[name, entries]], RESP3 {name: entries}. */
static PyObject *entries_of(PyObject *reply) {
    PyObject *entries = NULL;
    if (PyDict_CheckExact(reply) && PyDict_GET_SIZE(reply) == 1) {
        Py_ssize_t pos = 0;
        PyObject *name;
        PyDict_Next(reply, &pos, &name, &entries);
    } else if (PyList_CheckExact(reply) && PyList_GET_SIZE(reply) == 1) {
        PyObject *stream = PyList_GET_ITEM(reply, 0);
        if (PyList_CheckExact(stream) && PyList_GET_SIZE(stream) == 2)
            entries = PyList_GET_ITEM(stream, 1);
    }
    return entries != NULL && PyList_CheckExact(entries) && PyList_GET_SIZE(entries) > 0
               ? entries
               : NULL;
}

/* One entry as (msg, remaining_ms), its id appended to ack_ids; NULL: ask Python (no
 * error set) or an error (set). */
static PyObject *serve_entry(PyObject *entry, PyObject *decode, PyObject *lookup_type,
                             PyObject *now, const Limits *limits, PyObject *ack_ids) {
    if (!PyList_CheckExact(entry) || PyList_GET_SIZE(entry) != 2) return NULL;
    PyObject *entry_id = PyList_GET_ITEM(entry, 0);
    PyObject *m = m_field(PyList_GET_ITEM(entry, 1));
    if (!PyBytes_CheckExact(entry_id) || m == NULL) return NULL;
    long long stamp = stamp_ms(entry_id), end;
    PyObject *msg = PyObject_CallOneArg(decode, m);
    if (msg == NULL) {
        PyErr_Clear(); /* undecodable: Python dead-letters it, with the decoder's reason */
        return NULL;
    }
    long long budget;
    if ((PyObject *)Py_TYPE(msg) != lookup_type || !served(msg, limits, &budget)) {
        Py_DECREF(msg);
        return NULL;
    }
    if (stamp < 0 || __builtin_add_overflow(stamp, budget, &end)) {
        Py_DECREF(msg); /* no stamp: Python answers the whole budget; past 64 bits: Python's */
        return NULL;
    }
    double remaining = now == Py_None ? (double)budget : (double)end - PyFloat_AsDouble(now);
    if (PyList_Append(ack_ids, entry_id) < 0) {
        Py_DECREF(msg);
        return NULL;
    }
    PyObject *pair = Py_BuildValue("(Nd)", msg, remaining);
    return pair;
}

static PyObject *scan(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *reply, *decode, *lookup_type, *now;
    Limits limits;
    if (!PyArg_ParseTuple(args, "OOOOnnL:scan", &reply, &decode, &lookup_type, &now,
                          &limits.max_chunks, &limits.max_id_length, &limits.world_size))
        return NULL;
    if (now != Py_None && !PyFloat_CheckExact(now)) {
        PyErr_SetString(PyExc_TypeError, "now_ms must be a float or None");
        return NULL;
    }
    PyObject *entries = entries_of(reply);
    if (entries == NULL) Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(entries);
    PyObject *messages = PyList_New(0);
    PyObject *ack_ids = PyList_New(0);
    if (messages == NULL || ack_ids == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = serve_entry(PyList_GET_ITEM(entries, i), decode, lookup_type, now,
                                     &limits, ack_ids);
        if (pair == NULL) {
            if (PyErr_Occurred()) goto fail;
            Py_DECREF(messages);
            Py_DECREF(ack_ids);
            Py_RETURN_NONE;
        }
        int rc = PyList_Append(messages, pair);
        Py_DECREF(pair);
        if (rc < 0) goto fail;
    }
    return Py_BuildValue("(NN)", messages, ack_ids);
fail:
    Py_XDECREF(messages);
    Py_XDECREF(ack_ids);
    return NULL;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(reply, decode, lookup_type, now_ms, max_chunks, max_id_length, world_size)"
     " -> (messages, ack_ids) | None: the common batch of an XREADGROUP reply."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "workers.pipeline._scan",
    "The rank's common batch read in one C call (see workers.pipeline.reader).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__scan(void) {
    struct { PyObject **slot; const char *name; } names[] = {
        {&s_lookup_id, "lookup_id"}, {&s_hashes, "hashes"},
        {&s_offsets, "offsets"}, {&s_expected, "expected"}, {&s_tokens, "tokens"},
        {&s_budget_ms, "budget_ms"}, {&s_request_configs, "request_configs"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        *names[i].slot = PyUnicode_InternFromString(names[i].name);
        if (*names[i].slot == NULL) return NULL;
    }
    return PyModule_Create(&module);
}
