/*
 * workers.pipeline._dispatch: the dispatcher's common path around the engine, one C call each.
 *
 * Every lookup a rank serves passes three entry points of
 * workers.pipeline.dispatch.Dispatcher: the read loop hands it the request, the engine
 * reports, Redis answers the report. In Python each is a method and its helpers (counters,
 * the engine-time histogram, the report's tuple, the reporter's put), each a frame and a
 * lock on caches that Redis and the client emptied since the rank's last wake-up. Here:
 *
 *     handle(dispatcher, msg, remaining_ms)    Dispatcher._handle's start of a fresh id
 *     report(dispatcher, lookup_id, hits)      Dispatcher._report's send of a running job
 *     settle(dispatcher, report, answer)       Dispatcher._settle's hold of a kept report
 *     put(reporter, report)                    Reporter._put_report
 *     serve(dispatcher, messages)              Dispatcher._serve: a batch, in the
 *                                              reporter's window, through handle
 *
 * Each makes the common case exactly as the Python method would (the lifecycle's own try_*
 * transitions, the dispatcher's lock, counters and histogram, the reporter's lock and
 * riding list), or hands the call to the Python method that takes every other case, with
 * nothing changed. No rule lives here beyond "the case the Python path would take":
 * tests/unit/test_dispatch_equivalence.py runs both side by side and compares everything.
 * Every attribute is read per call, so a patched instance is seen as Python would see it.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_held.h"
#include <math.h>

static PyObject *s_tracker, *s_try_start, *s_try_report, *s_try_hold, *s_lock, *s_counts,
    *s_rank, *s_pin_ttl_s, *s_clock, *s_engine, *s_reporter,
    *s_riding, *s_enqueue, *s_put, *s_engine_seconds, *s_engine_seconds_sum, *s_lookup_id,
    *s_gen, *s_tokens, *s_hashes, *s_offsets, *s_expected, *s_request_configs, *s_started,
    *s_start_counter, *s_requests_counter, *s_handle_py, *s_handle_otherwise, *s_engine_failed,
    *s_report_otherwise, *s_invalid_hits, *s_settle_py, *s_settle_otherwise, *s_prefetch,
    *s_engine_kwnames, *s_handle, *s_close_window, *s_serve_py, *s_keep[3], *s_keep_counter[3];

static PyTypeObject *request_type; /* broker_lookup.protocol.messages.LookupRequest */
static PyTypeObject *report_type;  /* workers.pipeline.reporter.Report */
static double *buckets;            /* broker_lookup.ops.histogram.LATENCY_BUCKETS */
static Py_ssize_t n_buckets;
static PyObject *zero, *one;     /* 0 and 1 */

/* -- small helpers: each returns -1 (or NULL) with an exception set on failure ---------- */

/* obj.name(*args), at most 4 args: the result (a new reference) or NULL. */
static PyObject *call_method(PyObject *obj, PyObject *name, PyObject *const *args,
                             Py_ssize_t nargs) {
    PyObject *stack[5];
    stack[0] = obj;
    for (Py_ssize_t i = 0; i < nargs; i++) stack[i + 1] = args[i];
    return PyObject_VectorcallMethod(name, stack, (nargs + 1) | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                     NULL);
}

/* obj.name(*args) for its side effect: 0 or -1. */
static int call_void(PyObject *obj, PyObject *name, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *out = call_method(obj, name, args, nargs);
    if (out == NULL) return -1;
    Py_DECREF(out);
    return 0;
}

/* The dispatcher's clock (its ``_clock``) read: the value (a new reference, passed on to
 * Python as it came) and as a double in *now; NULL on an error. */
static PyObject *clock_now(PyObject *dispatcher, double *now) {
    PyObject *clock = PyObject_GetAttr(dispatcher, s_clock);
    if (clock == NULL) return NULL;
    PyObject *value = PyObject_CallNoArgs(clock);
    Py_DECREF(clock);
    if (value == NULL) return NULL;
    *now = PyFloat_AsDouble(value);
    if (*now == -1.0 && PyErr_Occurred()) Py_CLEAR(value);
    return value;
}

/* counts[key] = counts.get(key, 0) + 1, on the dispatcher's counter dict (lock held). */
static int bump(PyObject *counts, PyObject *key) {
    PyObject *old = PyDict_GetItemWithError(counts, key); /* borrowed */
    if (old == NULL && PyErr_Occurred()) return -1;
    PyObject *new = old == NULL ? PyLong_FromLong(1) : PyNumber_Add(old, one);
    if (new == NULL) return -1;
    int rc = PyDict_SetItem(counts, key, new);
    Py_DECREF(new);
    return rc;
}

/* Dispatcher.count for one or two counters, under one acquisition of its lock. */
static int count(PyObject *dispatcher, PyObject *first, PyObject *second) {
    PyObject *lk = held_lock(dispatcher, s_lock);
    if (lk == NULL) return -1;
    int rc = -1;
    PyObject *counts = PyObject_GetAttr(dispatcher, s_counts);
    if (counts != NULL && PyDict_Check(counts)) {
        rc = bump(counts, first);
        if (rc == 0 && second != NULL) rc = bump(counts, second);
    } else if (counts != NULL) {
        PyErr_SetString(PyExc_TypeError, "the dispatcher's _counts is not a dict");
    }
    Py_XDECREF(counts);
    held_unlock(lk);
    return rc;
}

/* Whether obj.name(*args) is true: 1, 0, or -1. */
static int call_truth(PyObject *obj, PyObject *name, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *out = call_method(obj, name, args, nargs);
    if (out == NULL) return -1;
    int truth = PyObject_IsTrue(out);
    Py_DECREF(out);
    return truth;
}

/* -- handle: a fresh id started on the engine ------------------------------------------ */

/* The remaining ms of an entry as a finite double in *out: 1, or 0 where it is anything
 * else (the Python path judges it). */
static int plain_remaining(PyObject *remaining_ms, double *out) {
    if (PyFloat_CheckExact(remaining_ms)) {
        *out = PyFloat_AS_DOUBLE(remaining_ms);
    } else if (PyLong_CheckExact(remaining_ms)) {
        int overflow;
        long long value = PyLong_AsLongLongAndOverflow(remaining_ms, &overflow);
        if (overflow || (value == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return 0;
        }
        if (value > (1LL << 53) || value < -(1LL << 53)) return 0; /* not exact as a double */
        *out = (double)value;
    } else {
        return 0;
    }
    return isfinite(*out) ? 1 : 0;
}

/* Dispatcher._start(req) past its counters: the engine's async_lookup_and_prefetch; an
 * Exception from it goes to Dispatcher._engine_failed(req, exc), as Python's except does. */
static int start_engine(PyObject *dispatcher, PyObject *req) {
    PyObject *engine = NULL, *lookup_id = NULL, *hashes = NULL, *offsets = NULL, *configs = NULL;
    int rc = -1;
    if ((engine = PyObject_GetAttr(dispatcher, s_engine)) == NULL) goto done;
    if ((lookup_id = PyObject_GetAttr(req, s_lookup_id)) == NULL) goto done;
    if ((hashes = PyObject_GetAttr(req, s_hashes)) == NULL) goto done;
    if ((offsets = PyObject_GetAttr(req, s_offsets)) == NULL) goto done;
    if ((configs = PyObject_GetAttr(req, s_request_configs)) == NULL) goto done;
    PyObject *stack[6] = {engine, lookup_id, hashes, offsets, Py_True, configs};
    PyObject *out = PyObject_VectorcallMethod(
        s_prefetch, stack, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, s_engine_kwnames);
    if (out != NULL) {
        Py_DECREF(out);
        rc = 0;
    } else if (PyErr_ExceptionMatches(PyExc_Exception)) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb != NULL) PyException_SetTraceback(value, tb);
        PyObject *args[2] = {req, value};
        rc = call_void(dispatcher, s_engine_failed, args, 2);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
    }
done:
    Py_XDECREF(engine);
    Py_XDECREF(lookup_id);
    Py_XDECREF(hashes);
    Py_XDECREF(offsets);
    Py_XDECREF(configs);
    return rc;
}

/* Whether the dispatcher's rank is among req.expected: 1, 0, or -1. */
static int expected_here(PyObject *dispatcher, PyObject *req) {
    PyObject *expected = PyObject_GetAttr(req, s_expected);
    if (expected == NULL) return -1;
    PyObject *rank = PyObject_GetAttr(dispatcher, s_rank);
    int has = rank == NULL ? -1 : PySequence_Contains(expected, rank);
    Py_DECREF(expected);
    Py_XDECREF(rank);
    return has;
}

/* The common case of Dispatcher._handle: 1 served, 0 not this case (nothing changed, the
 * Python method takes it whole), -1 error. */
static int handle_fresh(PyObject *dispatcher, PyObject *msg, PyObject *remaining_ms) {
    double remaining, now, pin_ttl;
    if (Py_TYPE(msg) != request_type || !plain_remaining(remaining_ms, &remaining)) return 0;
    if (remaining <= 0) return 0;
    int here = expected_here(dispatcher, msg);
    if (here != 1) return here;
    if (float_attr(dispatcher, s_pin_ttl_s, &pin_ttl) < 0) return -1;
    PyObject *now_obj = clock_now(dispatcher, &now);
    if (now_obj == NULL) return -1;
    /* min(remaining_ms / 1000, pin_ttl_s) as Python's min takes it: the first unless the
     * second is smaller. */
    double budget = remaining / 1000;
    double deadline = now + (pin_ttl < budget ? pin_ttl : budget);
    PyObject *tracker = PyObject_GetAttr(dispatcher, s_tracker);
    PyObject *deadline_obj = tracker == NULL ? NULL : PyFloat_FromDouble(deadline);
    int rc = -1;
    if (deadline_obj != NULL) {
        PyObject *args[3] = {msg, now_obj, deadline_obj};
        int started = call_truth(tracker, s_try_start, args, 3);
        if (started == 1) {
            rc = count(dispatcher, s_start_counter, s_requests_counter) < 0
                     ? -1
                     : start_engine(dispatcher, msg);
        } else if (started == 0) {
            rc = call_void(dispatcher, s_handle_otherwise, args, 3);
        }
    }
    Py_XDECREF(tracker);
    Py_DECREF(now_obj);
    Py_XDECREF(deadline_obj);
    return rc < 0 ? -1 : 1;
}

/* -- report: the engine's hits to the reporter ------------------------------------------ */

/* Dispatcher._observe(seconds): the engine-time histogram, under the dispatcher's lock. */
static int observe(PyObject *dispatcher, double seconds) {
    Py_ssize_t lo = 0, hi = n_buckets; /* bisect_left */
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (buckets[mid] < seconds) lo = mid + 1;
        else hi = mid;
    }
    PyObject *lk = held_lock(dispatcher, s_lock);
    if (lk == NULL) return -1;
    int rc = -1;
    PyObject *hist = PyObject_GetAttr(dispatcher, s_engine_seconds);
    PyObject *total = hist == NULL ? NULL : PyObject_GetAttr(dispatcher, s_engine_seconds_sum);
    if (total != NULL) {
        PyObject *old = PySequence_GetItem(hist, lo);
        PyObject *new = old == NULL ? NULL : PyNumber_Add(old, one);
        Py_XDECREF(old);
        if (new != NULL && PySequence_SetItem(hist, lo, new) == 0) {
            PyObject *delta = PyFloat_FromDouble(seconds);
            PyObject *sum = delta == NULL ? NULL : PyNumber_Add(total, delta);
            Py_XDECREF(delta);
            if (sum != NULL) rc = PyObject_SetAttr(dispatcher, s_engine_seconds_sum, sum);
            Py_XDECREF(sum);
        }
        Py_XDECREF(new);
    }
    Py_XDECREF(hist);
    Py_XDECREF(total);
    held_unlock(lk);
    return rc;
}

/* `hits` if it is an int in 0..tokens, else Dispatcher._invalid_hits(job, hits): a new
 * reference, or NULL. */
static PyObject *valid_hits(PyObject *dispatcher, PyObject *job, PyObject *hits) {
    if (PyLong_CheckExact(hits)) {
        PyObject *tokens = PyObject_GetAttr(job, s_tokens);
        if (tokens == NULL) return NULL;
        int ok = PyObject_RichCompareBool(zero, hits, Py_LE);
        if (ok == 1) ok = PyObject_RichCompareBool(hits, tokens, Py_LE);
        Py_DECREF(tokens);
        if (ok < 0) return NULL;
        if (ok) return Py_NewRef(hits);
    }
    PyObject *args[2] = {job, hits};
    return call_method(dispatcher, s_invalid_hits, args, 2);
}

/* Report(lookup_id, gen, hits): the NamedTuple made as its own __new__ makes it. */
static PyObject *new_report(PyObject *lookup_id, PyObject *gen, PyObject *hits) {
    PyObject *fields = PyTuple_Pack(4, lookup_id, gen, hits, Py_False);
    if (fields == NULL) return NULL;
    PyObject *args = PyTuple_Pack(1, fields);
    Py_DECREF(fields);
    if (args == NULL) return NULL;
    PyObject *report = PyTuple_Type.tp_new(report_type, args, NULL);
    Py_DECREF(args);
    return report;
}

/* Dispatcher._send_report(job, hits, now): observed, checked, to the reporter's put. */
static int send_report(PyObject *dispatcher, PyObject *job, PyObject *hits, double now) {
    double started;
    if (float_attr(job, s_started, &started) < 0) return -1;
    if (observe(dispatcher, now - started) < 0) return -1;
    PyObject *checked = valid_hits(dispatcher, job, hits);
    if (checked == NULL) return -1;
    PyObject *lookup_id = PyObject_GetAttr(job, s_lookup_id);
    PyObject *gen = lookup_id == NULL ? NULL : PyObject_GetAttr(job, s_gen);
    PyObject *report = gen == NULL ? NULL : new_report(lookup_id, gen, checked);
    PyObject *reporter = report == NULL ? NULL : PyObject_GetAttr(dispatcher, s_reporter);
    int rc = reporter == NULL ? -1 : call_void(reporter, s_put, &report, 1);
    Py_DECREF(checked);
    Py_XDECREF(lookup_id);
    Py_XDECREF(gen);
    Py_XDECREF(report);
    Py_XDECREF(reporter);
    return rc;
}

/* -- settle: Redis's answer to a report --------------------------------------------------- */

/* Which of the kept answers ("complete", "recorded", "duplicate") `answer` is, or -1. */
static int kept_answer(PyObject *answer) {
    if (!PyUnicode_CheckExact(answer)) return -1;
    for (int i = 0; i < 3; i++) {
        if (answer == s_keep[i] || PyUnicode_Compare(answer, s_keep[i]) == 0) return i;
    }
    if (PyErr_Occurred()) PyErr_Clear();
    return -1;
}

/* -- the module's functions ----------------------------------------------------------- */

static int ready(void) {
    if (request_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_dispatch.setup(...) was not called");
        return 0;
    }
    return 1;
}

/* Leave with a TypeError unless called with n arguments. */
#define ARGS(n, usage)                                             \
    do {                                                           \
        if (nargs != (n)) {                                        \
            PyErr_SetString(PyExc_TypeError, usage);               \
            return NULL;                                           \
        }                                                          \
    } while (0)

static PyObject *handle(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(3, "handle(dispatcher, msg, remaining_ms)");
    if (!ready()) return NULL;
    int rc = handle_fresh(args[0], args[1], args[2]);
    if (rc == 0) rc = call_void(args[0], s_handle_py, args + 1, 2);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *report(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(3, "report(dispatcher, lookup_id, hits)");
    if (!ready()) return NULL;
    PyObject *dispatcher = args[0], *lookup_id = args[1], *hits = args[2];
    double now;
    PyObject *now_obj = clock_now(dispatcher, &now);
    PyObject *tracker = now_obj == NULL ? NULL : PyObject_GetAttr(dispatcher, s_tracker);
    PyObject *job = NULL;
    int rc = -1;
    if (tracker != NULL) {
        PyObject *targs[2] = {lookup_id, now_obj};
        job = call_method(tracker, s_try_report, targs, 2);
    }
    if (job == Py_None) {
        PyObject *rargs[3] = {lookup_id, hits, now_obj};
        rc = call_void(dispatcher, s_report_otherwise, rargs, 3);
    } else if (job != NULL) {
        rc = send_report(dispatcher, job, hits, now);
    }
    Py_XDECREF(job);
    Py_XDECREF(tracker);
    Py_XDECREF(now_obj);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *settle(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(3, "settle(dispatcher, report, answer)");
    if (!ready()) return NULL;
    PyObject *dispatcher = args[0], *rep = args[1], *answer = args[2];
    int kept = kept_answer(answer);
    /* Progress, another answer, or not a plain Report: the Python method whole. */
    if (kept < 0 || Py_TYPE(rep) != report_type || PyTuple_GET_SIZE(rep) != 4 ||
        PyTuple_GET_ITEM(rep, 3) != Py_False) {
        if (call_void(dispatcher, s_settle_py, args + 1, 2) < 0) return NULL;
        Py_RETURN_NONE;
    }
    double now;
    PyObject *now_obj = clock_now(dispatcher, &now);
    PyObject *tracker = now_obj == NULL ? NULL : PyObject_GetAttr(dispatcher, s_tracker);
    int rc = -1;
    if (tracker != NULL) {
        PyObject *hargs[3] = {PyTuple_GET_ITEM(rep, 0), PyTuple_GET_ITEM(rep, 1), now_obj};
        int held = call_truth(tracker, s_try_hold, hargs, 3);
        if (held == 1) {
            rc = count(dispatcher, s_keep_counter[kept], NULL);
        } else if (held == 0) {
            PyObject *oargs[4] = {rep, answer, Py_True, now_obj};
            rc = call_void(dispatcher, s_settle_otherwise, oargs, 4);
        }
    }
    Py_XDECREF(tracker);
    Py_XDECREF(now_obj);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *put(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(2, "put(reporter, report)");
    PyObject *reporter = args[0];
    PyObject *lk = held_lock(reporter, s_lock);
    if (lk == NULL) return NULL;
    PyObject *riding = PyObject_GetAttr(reporter, s_riding);
    int rc = -1, rode = 0;
    if (riding != NULL && riding != Py_None) {
        rc = PyList_Check(riding) ? PyList_Append(riding, args[1]) : -1;
        if (rc < 0 && !PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "the reporter's _riding is not a list");
        rode = 1;
    } else if (riding != NULL) {
        rc = 0;
    }
    Py_XDECREF(riding);
    held_unlock(lk);
    if (rc == 0 && !rode) rc = call_void(reporter, s_enqueue, args + 1, 1);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* Reporter._close_window(failed=True): the batch failed, its reports go to the queue. */
static void close_failed_window(PyObject *reporter) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *out = PyObject_CallMethodOneArg(reporter, s_close_window, Py_True);
    if (out == NULL) {
        PyErr_WriteUnraisable(reporter); /* the batch's own error goes on */
    } else {
        Py_DECREF(out);
    }
    PyErr_Restore(type, value, tb);
}

/* reporter._riding = value (a new list, or None) under its lock: 0, or -1. */
static int set_riding(PyObject *reporter, PyObject *value) {
    PyObject *lk = held_lock(reporter, s_lock);
    if (lk == NULL) return -1;
    int rc = PyObject_SetAttr(reporter, s_riding, value);
    held_unlock(lk);
    return rc;
}

/* Whether messages is a list of (msg, remaining_ms) tuples, as the reader makes: anything
 * else is served by Dispatcher._serve. */
static int pairs(PyObject *messages) {
    if (!PyList_CheckExact(messages)) return 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(messages); i++) {
        PyObject *pair = PyList_GET_ITEM(messages, i);
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2) return 0;
    }
    return 1;
}

static PyObject *serve(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(2, "serve(dispatcher, messages)");
    if (!ready()) return NULL;
    PyObject *dispatcher = args[0], *messages = args[1];
    if (!pairs(messages)) return call_method(dispatcher, s_serve_py, &messages, 1);
    PyObject *reporter = PyObject_GetAttr(dispatcher, s_reporter);
    if (reporter == NULL) return NULL;
    PyObject *riding = PyList_New(0), *handle = NULL, *reports = NULL;
    /* Reporter._open_window. */
    if (riding == NULL || set_riding(reporter, riding) < 0) goto done;
    if ((handle = PyObject_GetAttr(dispatcher, s_handle)) == NULL) goto failed;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(messages); i++) {
        PyObject *pair = PyList_GET_ITEM(messages, i);
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2) {  /* a handle changed it */
            PyErr_SetString(PyExc_RuntimeError, "serve: the batch changed while served");
            goto failed;
        }
        Py_INCREF(pair); /* held across handle, which runs Python */
        PyObject *out = PyObject_Vectorcall(handle, &PyTuple_GET_ITEM(pair, 0), 2, NULL);
        Py_DECREF(pair);
        if (out == NULL) goto failed;
        Py_DECREF(out);
    }
    /* Reporter._close_window(failed=False): the window closed, its reports returned. */
    if (set_riding(reporter, Py_None) < 0) goto failed;
    reports = Py_NewRef(riding);
    goto done;
failed:
    close_failed_window(reporter);
done:
    Py_DECREF(reporter);
    Py_XDECREF(riding);
    Py_XDECREF(handle);
    return reports;
}

static PyObject *setup(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyType_Check(args[0]) || !PyType_Check(args[1]) ||
        !PyTuple_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "setup(LookupRequest, Report, buckets: tuple)");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(args[2]);
    double *values = PyMem_Calloc(n ? n : 1, sizeof(double));
    if (values == NULL) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        values[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(args[2], i));
        if (values[i] == -1.0 && PyErr_Occurred()) {
            PyMem_Free(values);
            return NULL;
        }
    }
    PyMem_Free(buckets);
    buckets = values;
    n_buckets = n;
    Py_INCREF(args[0]);
    Py_XSETREF(request_type, (PyTypeObject *)args[0]);
    Py_INCREF(args[1]);
    Py_XSETREF(report_type, (PyTypeObject *)args[1]);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"handle", (PyCFunction)(void (*)(void))handle, METH_FASTCALL,
     "handle(dispatcher, msg, remaining_ms): Dispatcher._handle, its fresh start in C"},
    {"report", (PyCFunction)(void (*)(void))report, METH_FASTCALL,
     "report(dispatcher, lookup_id, hits): Dispatcher._report, its send in C"},
    {"settle", (PyCFunction)(void (*)(void))settle, METH_FASTCALL,
     "settle(dispatcher, report, answer): Dispatcher._settle, its hold in C"},
    {"put", (PyCFunction)(void (*)(void))put, METH_FASTCALL,
     "put(reporter, report): Reporter._put_report in C"},
    {"serve", (PyCFunction)(void (*)(void))serve, METH_FASTCALL,
     "serve(dispatcher, messages) -> list[Report]: Dispatcher._serve in C"},
    {"setup", (PyCFunction)(void (*)(void))setup, METH_FASTCALL,
     "setup(LookupRequest, Report, LATENCY_BUCKETS): the types and buckets, once"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_dispatch",
    "The dispatcher's common path around the engine, one C call each (see _dispatch.c).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__dispatch(void) {
    INTERN(s_tracker, "_tracker");
    INTERN(s_try_start, "try_start");
    INTERN(s_try_report, "try_report");
    INTERN(s_try_hold, "try_hold");
    INTERN(s_lock, "_lock");
    INTERN(s_counts, "_counts");
    INTERN(s_rank, "_rank");
    INTERN(s_pin_ttl_s, "_pin_ttl_s");
    INTERN(s_clock, "_clock");
    INTERN(s_engine, "_engine");
    INTERN(s_reporter, "reporter");
    INTERN(s_riding, "_riding");
    INTERN(s_enqueue, "_enqueue");
    INTERN(s_put, "put");
    INTERN(s_engine_seconds, "engine_seconds");
    INTERN(s_engine_seconds_sum, "engine_seconds_sum");
    INTERN(s_lookup_id, "lookup_id");
    INTERN(s_gen, "gen");
    INTERN(s_tokens, "tokens");
    INTERN(s_hashes, "hashes");
    INTERN(s_offsets, "offsets");
    INTERN(s_expected, "expected");
    INTERN(s_request_configs, "request_configs");
    INTERN(s_started, "started");
    INTERN(s_start_counter, "start");
    INTERN(s_requests_counter, "requests");
    INTERN(s_handle_py, "_handle");
    INTERN(s_handle_otherwise, "_handle_otherwise");
    INTERN(s_engine_failed, "_engine_failed");
    INTERN(s_report_otherwise, "_report_otherwise");
    INTERN(s_invalid_hits, "_invalid_hits");
    INTERN(s_settle_py, "_settle");
    INTERN(s_settle_otherwise, "_settle_otherwise");
    INTERN(s_prefetch, "async_lookup_and_prefetch");
    INTERN(s_handle, "handle");
    INTERN(s_close_window, "_close_window");
    INTERN(s_serve_py, "_serve");
    INTERN(s_keep[0], "complete");
    INTERN(s_keep[1], "recorded");
    INTERN(s_keep[2], "duplicate");
    INTERN(s_keep_counter[0], "report_complete");
    INTERN(s_keep_counter[1], "report_recorded");
    INTERN(s_keep_counter[2], "report_duplicate");
    if (held_init() < 0) return NULL;
    PyObject *pin = PyUnicode_InternFromString("pin");
    PyObject *configs = PyUnicode_InternFromString("request_configs");
    if (pin == NULL || configs == NULL) return NULL;
    s_engine_kwnames = PyTuple_Pack(2, pin, configs);
    zero = PyLong_FromLong(0);
    one = PyLong_FromLong(1);
    if (zero == NULL || one == NULL) return NULL;
    Py_DECREF(pin);
    Py_DECREF(configs);
    if (s_engine_kwnames == NULL) return NULL;
    return PyModule_Create(&module);
}
