/*
 * workers.pipeline._pack: the bytes of a rank's write after a batch, in one C call.
 *
 * After serving a batch, the read loop writes the batch's XACK, the reports made
 * meanwhile (one report.lua EVALSHA each) and its next XREADGROUP in one sendall
 * (workers.pipeline.reporter). Built in Python that is a Call per report, a command tuple
 * per Call and hiredis' packer per tuple: inside a rank, on caches the blocking read
 * emptied, that costs about 25 µs a turn. A Packer holds what is fixed per rank (the
 * stream, the group, the script's sha, the done key, the rank, the report's limits and
 * the rank's fence: its lease key and token, fixed until the lease changes hands) already
 * framed, and packs the rest:
 *
 *     Packer(stream, group, sha, done_key, rank, done_maxlen, done_ttl_ms, key_of, fence)
 *     packer.pack(ack_ids, reports, read) -> bytes | None
 *
 * The bytes equal hiredis' packing of the commands the Python path builds
 * (Reporter._call, ScriptSet.command; tests/unit/test_pack_equivalence.py). The lookup
 * hash's key comes from `key_of` (KeySpace.lookup): the key scheme keeps one owner. A
 * report that is not a plain final report (a progress report, a value that is not an
 * exact int within 64 bits, an id that is not UTF-8) makes it return None, and the
 * Python path packs the write instead.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdio.h>
#include <string.h>

/* -- a growing byte buffer -------------------------------------------------------- */

typedef struct {
    char *data;
    Py_ssize_t len;
    Py_ssize_t cap;
} Buf;

static int buf_reserve(Buf *buf, Py_ssize_t more) {
    if (buf->len + more <= buf->cap) {
        return 0;
    }
    Py_ssize_t cap = buf->cap ? buf->cap : 1024;
    while (cap < buf->len + more) {
        cap *= 2;
    }
    char *data = PyMem_Realloc(buf->data, (size_t)cap);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    buf->data = data;
    buf->cap = cap;
    return 0;
}

static int buf_put(Buf *buf, const char *data, Py_ssize_t len) {
    if (buf_reserve(buf, len) < 0) {
        return -1;
    }
    memcpy(buf->data + buf->len, data, (size_t)len);
    buf->len += len;
    return 0;
}

/* "<kind><n>\r\n": an array's header ('*') or a bulk string's length ('$'). */
static int buf_header(Buf *buf, char kind, Py_ssize_t n) {
    char head[32];
    int len = snprintf(head, sizeof head, "%c%zd\r\n", kind, n);
    return buf_put(buf, head, len);
}

/* One bulk string: "$<len>\r\n<data>\r\n". */
static int buf_bulk(Buf *buf, const char *data, Py_ssize_t len) {
    if (buf_header(buf, '$', len) < 0 || buf_put(buf, data, len) < 0) {
        return -1;
    }
    return buf_put(buf, "\r\n", 2);
}

static int buf_int(Buf *buf, long long value) {
    char digits[24];
    int len = snprintf(digits, sizeof digits, "%lld", value);
    return buf_bulk(buf, digits, len);
}

/* -- one argument as hiredis packs it -------------------------------------------------- */

/* 1: packed; 0: not an argument this packer takes (no error set); -1: error set. */
static int put_arg(Buf *buf, PyObject *arg) {
    if (PyBytes_CheckExact(arg)) {
        return buf_bulk(buf, PyBytes_AS_STRING(arg), PyBytes_GET_SIZE(arg)) < 0 ? -1 : 1;
    }
    if (PyUnicode_CheckExact(arg)) {
        Py_ssize_t len;
        const char *text = PyUnicode_AsUTF8AndSize(arg, &len);
        if (text == NULL) {  /* lone surrogates: the Python path says what is wrong */
            PyErr_Clear();
            return 0;
        }
        return buf_bulk(buf, text, len) < 0 ? -1 : 1;
    }
    if (PyLong_CheckExact(arg)) {
        int overflow = 0;
        long long value = PyLong_AsLongLongAndOverflow(arg, &overflow);
        if (overflow || (value == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return 0;
        }
        return buf_int(buf, value) < 0 ? -1 : 1;
    }
    return 0;
}

/* -- the Packer ------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject *key_of;     /* lookup id -> the lookup hash's key (KeySpace.lookup) */
    PyObject *xack_head;  /* bytes: "XACK", stream, group, framed */
    PyObject *report_head; /* bytes: the array header, "EVALSHA", sha, "2", framed */
    PyObject *report_mid;  /* bytes: the done key (, the lease key) and the rank, framed */
    PyObject *maxlen;      /* bytes: done_maxlen, framed */
    PyObject *ttl;         /* bytes: done_ttl_ms (, the fencing token), framed */
} Packer;

/* The bulk strings of `args` (str or int), framed, as one bytes object. */
static PyObject *framed(PyObject *args) {
    Buf buf = {NULL, 0, 0};
    PyObject *out = NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); i++) {
        int put = put_arg(&buf, PyTuple_GET_ITEM(args, i));
        if (put <= 0) {
            if (put == 0) {
                PyErr_Format(PyExc_TypeError, "Packer: argument %zd is not a str or an int", i);
            }
            goto done;
        }
    }
    out = PyBytes_FromStringAndSize(buf.data ? buf.data : "", buf.len);
done:
    PyMem_Free(buf.data);
    return out;
}

static int Packer_init(Packer *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"stream", "group", "sha", "done_key", "rank",
                            "done_maxlen", "done_ttl_ms", "key_of", "fence", NULL};
    PyObject *stream, *group, *sha, *done_key, *rank, *maxlen, *ttl, *key_of;
    PyObject *fence = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "UUUUO!O!O!O|O:Packer", names, &stream,
                                     &group, &sha, &done_key, &PyLong_Type, &rank,
                                     &PyLong_Type, &maxlen, &PyLong_Type, &ttl, &key_of,
                                     &fence)) {
        return -1;
    }
    if (!PyCallable_Check(key_of)) {
        PyErr_SetString(PyExc_TypeError, "Packer: key_of must be callable");
        return -1;
    }
    /* fence: None, or (lease key, token): report.lua's KEYS[3] and ARGV[7] */
    int fenced = fence != Py_None;
    if (fenced && !(PyTuple_Check(fence) && PyTuple_GET_SIZE(fence) == 2)) {
        PyErr_SetString(PyExc_TypeError, "Packer: fence must be None or (lease key, token)");
        return -1;
    }
    PyObject *xack = Py_BuildValue("(sOO)", "XACK", stream, group);
    PyObject *head = Py_BuildValue("(sOs)", "EVALSHA", sha, fenced ? "3" : "2");
    PyObject *mid = fenced ? Py_BuildValue("(OOO)", done_key, PyTuple_GET_ITEM(fence, 0), rank)
                           : Py_BuildValue("(OO)", done_key, rank);
    PyObject *one_maxlen = Py_BuildValue("(O)", maxlen);
    PyObject *one_ttl = fenced ? Py_BuildValue("(OO)", ttl, PyTuple_GET_ITEM(fence, 1))
                               : Py_BuildValue("(O)", ttl);
    int ok = xack && head && mid && one_maxlen && one_ttl;
    if (ok) {
        Py_XSETREF(self->xack_head, framed(xack));
        PyObject *body = framed(head);
        if (body != NULL) {
            /* EVALSHA sha numkeys, then two keys and six ARGV (report.lua's header), or
               fenced three keys and seven ARGV: "*11" or "*13" */
            Py_XSETREF(self->report_head, PyBytes_FromFormat("*%d\r\n%s", fenced ? 13 : 11,
                                                             PyBytes_AS_STRING(body)));
            Py_DECREF(body);
        }
        Py_XSETREF(self->report_mid, framed(mid));
        Py_XSETREF(self->maxlen, framed(one_maxlen));
        Py_XSETREF(self->ttl, framed(one_ttl));
        Py_INCREF(key_of);
        Py_XSETREF(self->key_of, key_of);
        ok = self->xack_head && self->report_head && self->report_mid && self->maxlen &&
             self->ttl;
    }
    Py_XDECREF(xack);
    Py_XDECREF(head);
    Py_XDECREF(mid);
    Py_XDECREF(one_maxlen);
    Py_XDECREF(one_ttl);
    return ok ? 0 : -1;
}

static int put_bytes(Buf *buf, PyObject *bytes) {
    return buf_put(buf, PyBytes_AS_STRING(bytes), PyBytes_GET_SIZE(bytes));
}

/* One report as report.lua's EVALSHA; same return convention as put_arg. */
static int put_report(Packer *self, Buf *buf, PyObject *report) {
    if (!PyTuple_Check(report) || PyTuple_GET_SIZE(report) != 4 ||
        PyTuple_GET_ITEM(report, 3) != Py_False) {
        return 0;  /* not a Report, or a progress report */
    }
    PyObject *lookup_id = PyTuple_GET_ITEM(report, 0);
    PyObject *gen = PyTuple_GET_ITEM(report, 1);
    PyObject *hits = PyTuple_GET_ITEM(report, 2);
    if (!PyUnicode_CheckExact(lookup_id) || !PyLong_CheckExact(gen) || !PyLong_CheckExact(hits)) {
        return 0;
    }
    PyObject *key = PyObject_CallOneArg(self->key_of, lookup_id);
    if (key == NULL) {
        return -1;
    }
    int put = put_bytes(buf, self->report_head) < 0 ? -1
              : PyUnicode_CheckExact(key)           ? put_arg(buf, key)
                                                    : 0;
    Py_DECREF(key);
    if (put != 1) {
        return put;
    }
    if (put_bytes(buf, self->report_mid) < 0) {
        return -1;
    }
    if ((put = put_arg(buf, gen)) != 1 || (put = put_arg(buf, hits)) != 1) {
        return put;
    }
    if (put_bytes(buf, self->maxlen) < 0) {
        return -1;
    }
    if ((put = put_arg(buf, lookup_id)) != 1) {
        return put;
    }
    return put_bytes(buf, self->ttl) < 0 ? -1 : 1;
}

/* The whole write; same return convention as put_arg. */
static int put_write(Packer *self, Buf *buf, PyObject *ack_ids, PyObject *reports,
                     PyObject *read) {
    Py_ssize_t n_acks = PyList_GET_SIZE(ack_ids);
    if (n_acks) {
        if (buf_header(buf, '*', 3 + n_acks) < 0 || put_bytes(buf, self->xack_head) < 0) {
            return -1;
        }
        for (Py_ssize_t i = 0; i < n_acks; i++) {
            PyObject *entry_id = PyList_GET_ITEM(ack_ids, i);
            if (!PyBytes_CheckExact(entry_id)) {
                return 0;
            }
            int put = put_arg(buf, entry_id);
            if (put <= 0) {
                return put;
            }
        }
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(reports); i++) {
        int put = put_report(self, buf, PyList_GET_ITEM(reports, i));
        if (put <= 0) {
            return put;
        }
    }
    if (read == Py_None) {
        return 1;
    }
    if (!PyTuple_CheckExact(read) || buf_header(buf, '*', PyTuple_GET_SIZE(read)) < 0) {
        return PyErr_Occurred() ? -1 : 0;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(read); i++) {
        int put = put_arg(buf, PyTuple_GET_ITEM(read, i));
        if (put <= 0) {
            return put;
        }
    }
    return 1;
}

static PyObject *Packer_pack(Packer *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_CheckExact(args[0]) || !PyList_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "pack(ack_ids: list, reports: list, read)");
        return NULL;
    }
    if (self->key_of == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Packer was not initialised");
        return NULL;
    }
    Buf buf = {NULL, 0, 0};
    PyObject *out = NULL;
    int put = put_write(self, &buf, args[0], args[1], args[2]);
    if (put == 1) {
        out = PyBytes_FromStringAndSize(buf.data ? buf.data : "", buf.len);
    } else if (put == 0) {
        out = Py_NewRef(Py_None);
    }
    PyMem_Free(buf.data);
    return out;
}

static int Packer_traverse(Packer *self, visitproc visit, void *arg) {
    Py_VISIT(self->key_of);
    return 0;
}

static int Packer_clear(Packer *self) {
    Py_CLEAR(self->key_of);
    Py_CLEAR(self->xack_head);
    Py_CLEAR(self->report_head);
    Py_CLEAR(self->report_mid);
    Py_CLEAR(self->maxlen);
    Py_CLEAR(self->ttl);
    return 0;
}

static void Packer_dealloc(Packer *self) {
    PyObject_GC_UnTrack(self);
    Packer_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Packer_methods[] = {
    {"pack", (PyCFunction)(void (*)(void))Packer_pack, METH_FASTCALL,
     "pack(ack_ids, reports, read) -> bytes | None: the XACK, the reports' EVALSHAs and "
     "the read (a command tuple, or None), packed; None if a report is not a plain one."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PackerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "workers.pipeline._pack.Packer",
    .tp_basicsize = sizeof(Packer),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The bytes of one rank's write after a batch (see the module docstring).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Packer_init,
    .tp_dealloc = (destructor)Packer_dealloc,
    .tp_traverse = (traverseproc)Packer_traverse,
    .tp_clear = (inquiry)Packer_clear,
    .tp_methods = Packer_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "workers.pipeline._pack",
    "A rank's write after a batch, packed in one call (see _pack.c).", -1, NULL,
};

PyMODINIT_FUNC PyInit__pack(void) {
    if (PyType_Ready(&PackerType) < 0) {
        return NULL;
    }
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(mod, "Packer", (PyObject *)&PackerType) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
