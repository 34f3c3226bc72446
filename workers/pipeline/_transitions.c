/*
 * workers.pipeline._transitions: the lifecycle's three common transitions, one C call each.
 *
 * Every lookup a rank serves goes through the same three steps of
 * workers.pipeline.lifecycle.Lifecycle: a fresh id starts, its engine reports, Redis keeps
 * the report and the rank holds the pins. In Python each is a method, its helpers and their
 * locks, dicts and heap on caches that Redis and the client emptied since the rank's last
 * wake-up; here each is one call:
 *
 *     start(lifecycle, req, now, deadline) -> bool      on_request's "start" of a fresh id
 *     report(lifecycle, lookup_id, now) -> Job | None   on_report's "report"
 *     hold(lifecycle, lookup_id, gen, now) -> bool      on_settled's hold of a kept report
 *
 * Each takes the lifecycle's own lock and either makes the transition exactly as the Python
 * method would, on the lifecycle's own maps, or changes nothing and answers False / None,
 * and the Python method decides (a duplicate, an abort, a newer generation, a partial
 * answer, anything else). So this file holds no rule of its own beyond "only the case the
 * Python path would take": tests/unit/test_transitions_equivalence.py drives random
 * sequences through both and compares every map.
 *
 * A timer, hold, awaited report or memo change is what the Python helpers do
 * (Lifecycle._begin, _timer, _await_settle, _move, _hold and Memo.add); where one of them
 * would ring the sweeper, the lifecycle's own _sooner is called, as Python calls it.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_held.h"

static PyObject *s_lock, *s_jobs, *s_seen, *s_aborted, *s_states, *s_timers, *s_unsettled,
    *s_seq, *s_wake_at, *s_memo_ttl_s, *s_grace_s, *s_pin_ttl_s, *s_held, *s_waiting, *s_capacity,
    *s_sooner, *s_popitem, *s_lookup_id, *s_gen, *s_tokens, *s_state,
    *s_aborted_attr, *s_superseded, *s_kept, *s_running, *s_reporting, *s_held_state;

static PyObject *job_type;  /* workers.pipeline.lifecycle.Job, given by setup() */
static PyObject *heappush;  /* heapq.heappush */

/* -- small helpers: each returns -1 with an exception set on failure --------------------- */

/* An int attribute of obj in *out. */
static int ssize_attr(PyObject *obj, PyObject *name, Py_ssize_t *out) {
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL) return -1;
    *out = PyLong_AsSsize_t(value);
    Py_DECREF(value);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* Whether attribute `name` of obj is truthy: 1, 0, or -1. */
static int true_attr(PyObject *obj, PyObject *name) {
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL) return -1;
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

/* Whether attribute `name` of obj is falsy: 1, 0, or -1. */
static int false_attr(PyObject *obj, PyObject *name) {
    int truth = true_attr(obj, name);
    return truth < 0 ? -1 : !truth;
}

/* Whether attribute `name` of obj equals `expected`: 1, 0, or -1. */
static int attr_equals(PyObject *obj, PyObject *name, PyObject *expected) {
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL) return -1;
    int equal = PyObject_RichCompareBool(value, expected, Py_EQ);
    Py_DECREF(value);
    return equal;
}

/* states[key] += delta, as the lifecycle's plain dict of state sizes. */
static int add_to_state(PyObject *states, PyObject *key, long delta) {
    PyObject *old = PyDict_GetItemWithError(states, key);  /* borrowed */
    if (old == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    long value = PyLong_AsLong(old);
    if (value == -1 && PyErr_Occurred()) return -1;
    PyObject *new = PyLong_FromLong(value + delta);
    if (new == NULL) return -1;
    int rc = PyDict_SetItem(states, key, new);
    Py_DECREF(new);
    return rc;
}

/* Lifecycle._move(job, state): the state sizes and the job's state. */
static int move(PyObject *states, PyObject *job, PyObject *state) {
    PyObject *old = PyObject_GetAttr(job, s_state);
    if (old == NULL) return -1;
    int rc = add_to_state(states, old, -1);
    Py_DECREF(old);
    if (rc < 0 || add_to_state(states, state, 1) < 0) return -1;
    return PyObject_SetAttr(job, s_state, state);
}

/* The lifecycle's _sooner(when). */
static int sooner(PyObject *lc, double when) {
    PyObject *arg = PyFloat_FromDouble(when);
    if (arg == NULL) return -1;
    PyObject *out = PyObject_CallMethodOneArg(lc, s_sooner, arg);
    Py_DECREF(arg);
    if (out == NULL) return -1;
    Py_DECREF(out);
    return 0;
}

/* The lifecycle's _sooner(when) where `when` falls before the sweeper's planned wake. */
static int ring_if_sooner(PyObject *lc, double when) {
    double wake_at;
    if (float_attr(lc, s_wake_at, &wake_at) < 0) return -1;
    return when < wake_at ? sooner(lc, when) : 0;
}

/* Lifecycle._timer(when, job) for a job of (lookup_id, gen) in `state`. */
static int push_timer(PyObject *lc, double when, PyObject *lookup_id, PyObject *gen,
                      PyObject *state) {
    PyObject *timers = PyObject_GetAttr(lc, s_timers);
    if (timers == NULL) return -1;
    PyObject *seq = PyObject_GetAttr(lc, s_seq);
    PyObject *n = seq == NULL ? NULL : PyIter_Next(seq);
    Py_XDECREF(seq);
    if (n == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "timer sequence ended");
        Py_DECREF(timers);
        return -1;
    }
    PyObject *when_obj = PyFloat_FromDouble(when);
    PyObject *entry = when_obj == NULL ? NULL : PyTuple_Pack(5, when_obj, n, lookup_id, gen, state);
    Py_XDECREF(when_obj);
    Py_DECREF(n);
    PyObject *out = entry == NULL ? NULL : PyObject_CallFunctionObjArgs(heappush, timers, entry, NULL);
    Py_XDECREF(entry);
    Py_DECREF(timers);
    if (out == NULL) return -1;
    Py_DECREF(out);
    return ring_if_sooner(lc, when);
}

/* Memo.add(key, expires) for a key the memo does not hold: appended, oldest past capacity
 * forgotten. */
static int memo_add(PyObject *memo, PyObject *key, double expires) {
    PyObject *value = PyFloat_FromDouble(expires);
    if (value == NULL) return -1;
    int rc = PyObject_SetItem(memo, key, value);
    Py_DECREF(value);
    if (rc < 0) return -1;
    Py_ssize_t capacity;
    if (ssize_attr(memo, s_capacity, &capacity) < 0) return -1;
    Py_ssize_t size;
    while ((size = PyObject_Size(memo)) > capacity) {
        PyObject *out = PyObject_CallMethodOneArg(memo, s_popitem, Py_False);
        if (out == NULL) return -1;
        Py_DECREF(out);
    }
    return size < 0 ? -1 : 0;
}

/* -- the three transitions ------------------------------------------------------------- */

/* Leave with result 0 (not the common case: the Python method decides) unless `item` is
 * absent from `container`; -1 on an error. */
#define ONLY_IF_ABSENT(container, item)                            \
    do {                                                           \
        int has_ = PySequence_Contains((container), (item));       \
        if (has_ != 0) {                                           \
            result = has_ < 0 ? -1 : 0;                            \
            goto done;                                             \
        }                                                          \
    } while (0)

/* Leave with result 0 unless `check` (a 1 / 0 / -1 call) is 1; -1 on an error. */
#define ONLY_IF(check)                                             \
    do {                                                           \
        int ok_ = (check);                                         \
        if (ok_ != 1) {                                            \
            result = ok_ < 0 ? -1 : 0;                             \
            goto done;                                             \
        }                                                          \
    } while (0)

/* The job the lifecycle holds for lookup_id: 1 (a new reference in *out), 0 none, -1 error. */
static int job_of(PyObject *lc, PyObject *lookup_id, PyObject **out) {
    PyObject *jobs = PyObject_GetAttr(lc, s_jobs);
    if (jobs == NULL) return -1;
    *out = PyObject_GetItem(jobs, lookup_id);
    Py_DECREF(jobs);
    if (*out != NULL) return 1;
    if (!PyErr_ExceptionMatches(PyExc_KeyError)) return -1;
    PyErr_Clear();
    return 0;
}

/* on_request's first "start": a fresh id (nothing runs for it, (id, gen) neither seen nor
 * aborted, gen >= 0) is remembered, becomes a running Job and gets its watchdog timer.
 * Under the lock: 1 started, 0 not this case (nothing changed), -1 error. */
static int start_locked(PyObject *lc, PyObject *req, PyObject *lookup_id, PyObject *gen,
                        double now, double deadline) {
    int result = -1;
    PyObject *key = NULL, *jobs = NULL, *seen = NULL, *aborted = NULL, *tokens = NULL,
             *job = NULL, *states = NULL;
    double memo_ttl, grace;
    if ((key = PyTuple_Pack(2, lookup_id, gen)) == NULL) goto done;
    if ((jobs = PyObject_GetAttr(lc, s_jobs)) == NULL) goto done;
    if ((seen = PyObject_GetAttr(lc, s_seen)) == NULL) goto done;
    if ((aborted = PyObject_GetAttr(lc, s_aborted)) == NULL) goto done;
    ONLY_IF_ABSENT(jobs, lookup_id);
    ONLY_IF_ABSENT(seen, key);
    ONLY_IF_ABSENT(aborted, key);
    if (float_attr(lc, s_memo_ttl_s, &memo_ttl) < 0) goto done;
    if (float_attr(lc, s_grace_s, &grace) < 0) goto done;
    if ((tokens = PyObject_GetAttr(req, s_tokens)) == NULL) goto done;
    if ((states = PyObject_GetAttr(lc, s_states)) == NULL) goto done;
    if (!PyDict_Check(states)) {
        result = 0;
        goto done;
    }
    /* From here on it changes the maps, in the Python path's order. */
    if (memo_add(seen, key, now + memo_ttl) < 0) goto done;
    job = PyObject_CallFunction(job_type, "OOOdd", lookup_id, gen, tokens, now, deadline);
    if (job == NULL || PyObject_SetItem(jobs, lookup_id, job) < 0) goto done;
    if (add_to_state(states, s_running, 1) < 0) goto done;
    if (push_timer(lc, deadline + grace, lookup_id, gen, s_running) < 0) goto done;
    result = 1;
done:
    Py_XDECREF(key);
    Py_XDECREF(jobs);
    Py_XDECREF(seen);
    Py_XDECREF(aborted);
    Py_XDECREF(tokens);
    Py_XDECREF(job);
    Py_XDECREF(states);
    return result;
}

/* Lifecycle._await_settle(job, when): the reporting id awaits its report's answer. */
static int await_settle(PyObject *lc, double when, PyObject *lookup_id) {
    PyObject *unsettled = PyObject_GetAttr(lc, s_unsettled);
    if (unsettled == NULL) return -1;
    PyObject *when_obj = PyFloat_FromDouble(when);
    int rc = when_obj == NULL ? -1 : PyObject_SetItem(unsettled, lookup_id, when_obj);
    Py_XDECREF(when_obj);
    Py_DECREF(unsettled);
    return rc < 0 ? -1 : ring_if_sooner(lc, when);
}

/* The reporting id's report settled (Lifecycle._move out of reporting). */
static int settled(PyObject *lc, PyObject *lookup_id) {
    PyObject *unsettled = PyObject_GetAttr(lc, s_unsettled);
    if (unsettled == NULL) return -1;
    int rc = PyObject_DelItem(unsettled, lookup_id);
    Py_DECREF(unsettled);
    return rc;
}

/* on_report's "report": a running job, neither aborted, superseded nor kept, moves to
 * reporting, awaiting its report's answer until the pin TTL. Under the lock: 1 (the job in
 * *out, a new reference), 0 not this case, -1 error. */
static int report_locked(PyObject *lc, PyObject *lookup_id, double now, PyObject **out) {
    int result = -1;
    PyObject *job = NULL, *states = NULL;
    double pin_ttl;
    ONLY_IF(job_of(lc, lookup_id, &job));
    ONLY_IF(attr_equals(job, s_state, s_running));
    ONLY_IF(false_attr(job, s_aborted_attr));
    ONLY_IF(false_attr(job, s_superseded));
    ONLY_IF(attr_equals(job, s_kept, Py_None));
    if (float_attr(lc, s_pin_ttl_s, &pin_ttl) < 0) goto done;
    if ((states = PyObject_GetAttr(lc, s_states)) == NULL) goto done;
    if (move(states, job, s_reporting) < 0) goto done;
    if (await_settle(lc, now + pin_ttl, lookup_id) < 0) goto done;
    *out = job;
    job = NULL;
    result = 1;
done:
    Py_XDECREF(job);
    Py_XDECREF(states);
    return result;
}

/* on_settled's hold: the reporting job of (lookup_id, gen), not aborted, with no newer
 * generation waiting, is held until the pin TTL. Under the lock: 1 held, 0 not this case,
 * -1 error. */
static int hold_locked(PyObject *lc, PyObject *lookup_id, PyObject *gen, double now) {
    int result = -1;
    PyObject *job = NULL, *waiting = NULL, *held = NULL, *states = NULL, *until_obj = NULL;
    double pin_ttl, wake_at;
    Py_ssize_t capacity, size;
    ONLY_IF(job_of(lc, lookup_id, &job));
    ONLY_IF(attr_equals(job, s_gen, gen));
    ONLY_IF(attr_equals(job, s_state, s_reporting));
    ONLY_IF(false_attr(job, s_aborted_attr));
    if ((waiting = PyObject_GetAttr(lc, s_waiting)) == NULL) goto done;
    ONLY_IF_ABSENT(waiting, lookup_id);
    if (float_attr(lc, s_pin_ttl_s, &pin_ttl) < 0) goto done;
    if ((held = PyObject_GetAttr(lc, s_held)) == NULL) goto done;
    if ((states = PyObject_GetAttr(lc, s_states)) == NULL) goto done;
    /* Lifecycle._hold. */
    if (settled(lc, lookup_id) < 0) goto done;
    if (move(states, job, s_held_state) < 0) goto done;
    double until = now + pin_ttl;
    if ((until_obj = PyFloat_FromDouble(until)) == NULL) goto done;
    if (PyObject_SetItem(held, lookup_id, until_obj) < 0) goto done;
    if (float_attr(lc, s_wake_at, &wake_at) < 0) goto done;
    if (until < wake_at) {
        if (sooner(lc, until) < 0) goto done;
    } else {
        if (ssize_attr(lc, s_capacity, &capacity) < 0) goto done;
        if ((size = PyObject_Size(held)) < 0) goto done;
        if (size > capacity && sooner(lc, -Py_HUGE_VAL) < 0) goto done;
    }
    result = 1;
done:
    Py_XDECREF(job);
    Py_XDECREF(waiting);
    Py_XDECREF(held);
    Py_XDECREF(states);
    Py_XDECREF(until_obj);
    return result;
}

/* -- the module's functions ----------------------------------------------------------- */

static int ready(void) {
    if (job_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_transitions.setup(Job) was not called");
        return 0;
    }
    return 1;
}

static PyObject *start(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    double now, deadline;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "start(lifecycle, req, now, deadline)");
        return NULL;
    }
    if (!ready()) return NULL;
    PyObject *lc = args[0], *req = args[1];
    now = PyFloat_AsDouble(args[2]);
    deadline = PyFloat_AsDouble(args[3]);
    if (PyErr_Occurred()) return NULL;
    PyObject *lookup_id = PyObject_GetAttr(req, s_lookup_id);
    PyObject *gen = lookup_id == NULL ? NULL : PyObject_GetAttr(req, s_gen);
    int result = -1;
    if (gen != NULL) {
        long long g = PyLong_Check(gen) ? PyLong_AsLongLong(gen) : -1;
        if (g == -1 && PyErr_Occurred()) PyErr_Clear();  /* past 64 bits: Python's */
        result = 0;
        if (g >= 0 && PyUnicode_CheckExact(lookup_id)) {
            PyObject *lk = held_lock(lc, s_lock);
            result = lk == NULL ? -1 : start_locked(lc, req, lookup_id, gen, now, deadline);
            if (lk != NULL) held_unlock(lk);
        }
    }
    Py_XDECREF(lookup_id);
    Py_XDECREF(gen);
    if (result < 0) return NULL;
    return PyBool_FromLong(result);
}

static PyObject *report(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "report(lifecycle, lookup_id, now)");
        return NULL;
    }
    if (!ready()) return NULL;
    double now = PyFloat_AsDouble(args[2]);
    if (now == -1.0 && PyErr_Occurred()) return NULL;
    PyObject *job = NULL;
    PyObject *lk = held_lock(args[0], s_lock);
    if (lk == NULL) return NULL;
    int result = report_locked(args[0], args[1], now, &job);
    held_unlock(lk);
    if (result < 0) return NULL;
    if (result == 0) Py_RETURN_NONE;
    return job;
}

static PyObject *hold(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "hold(lifecycle, lookup_id, gen, now)");
        return NULL;
    }
    if (!ready()) return NULL;
    double now = PyFloat_AsDouble(args[3]);
    if (now == -1.0 && PyErr_Occurred()) return NULL;
    PyObject *lk = held_lock(args[0], s_lock);
    if (lk == NULL) return NULL;
    int result = hold_locked(args[0], args[1], args[2], now);
    held_unlock(lk);
    if (result < 0) return NULL;
    return PyBool_FromLong(result);
}

static PyObject *setup(PyObject *self, PyObject *job) {
    Py_INCREF(job);
    Py_XSETREF(job_type, job);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"start", (PyCFunction)(void (*)(void))start, METH_FASTCALL,
     "start(lifecycle, req, now, deadline) -> bool: on_request's start of a fresh id"},
    {"report", (PyCFunction)(void (*)(void))report, METH_FASTCALL,
     "report(lifecycle, lookup_id, now) -> Job | None: on_report's report"},
    {"hold", (PyCFunction)(void (*)(void))hold, METH_FASTCALL,
     "hold(lifecycle, lookup_id, gen, now) -> bool: on_settled's hold"},
    {"setup", setup, METH_O, "setup(Job): the job class the lifecycle makes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_transitions",
    "The lifecycle's three common transitions, one C call each (see _transitions.c).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__transitions(void) {
    INTERN(s_lock, "_lock");
    INTERN(s_jobs, "_jobs");
    INTERN(s_seen, "_seen");
    INTERN(s_aborted, "_aborted");
    INTERN(s_states, "_states");
    INTERN(s_timers, "_timers");
    INTERN(s_unsettled, "_unsettled");
    INTERN(s_seq, "_seq");
    INTERN(s_wake_at, "_wake_at");
    INTERN(s_memo_ttl_s, "_memo_ttl_s");
    INTERN(s_grace_s, "_grace_s");
    INTERN(s_pin_ttl_s, "_pin_ttl_s");
    INTERN(s_held, "_held");
    INTERN(s_waiting, "_waiting");
    INTERN(s_capacity, "_capacity");
    INTERN(s_sooner, "_sooner");
    INTERN(s_popitem, "popitem");
    INTERN(s_lookup_id, "lookup_id");
    INTERN(s_gen, "gen");
    INTERN(s_tokens, "tokens");
    INTERN(s_state, "state");
    INTERN(s_aborted_attr, "aborted");
    INTERN(s_superseded, "superseded");
    INTERN(s_kept, "kept");
    INTERN(s_running, "running");
    INTERN(s_reporting, "reporting");
    INTERN(s_held_state, "held");
    if (held_init() < 0) return NULL;
    PyObject *heapq = PyImport_ImportModule("heapq");
    if (heapq == NULL) return NULL;
    heappush = PyObject_GetAttrString(heapq, "heappush");
    Py_DECREF(heapq);
    if (heappush == NULL) return NULL;
    return PyModule_Create(&module);
}
