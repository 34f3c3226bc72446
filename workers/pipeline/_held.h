/*
 * What the rank pipeline's C extensions (_transitions.c, _dispatch.c) share: reading a float
 * attribute, holding a Python object's threading.Lock from C (the same lock its Python
 * methods take), and interning the attribute names at import. Each extension includes it
 * and calls held_init() once, in its module init.
 */

#ifndef WORKERS_PIPELINE_HELD_H
#define WORKERS_PIPELINE_HELD_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *held_acquire, *held_release; /* "acquire", "release", interned */

/* In a module init: var = the interned text, or return NULL. */
#define INTERN(var, text)                                       \
    do {                                                        \
        if ((var = PyUnicode_InternFromString(text)) == NULL)   \
            return NULL;                                        \
    } while (0)

/* The interned method names; 0, or -1 with an exception set. */
static int held_init(void) {
    held_acquire = PyUnicode_InternFromString("acquire");
    held_release = PyUnicode_InternFromString("release");
    return held_acquire != NULL && held_release != NULL ? 0 : -1;
}

/* obj.name as a double in *out: 0, or -1 with an exception set. */
static int float_attr(PyObject *obj, PyObject *name, double *out) {
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL) return -1;
    *out = PyFloat_AsDouble(value);
    Py_DECREF(value);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* obj.<lock_name>, acquired: a new reference to give to held_unlock, or NULL. */
static PyObject *held_lock(PyObject *obj, PyObject *lock_name) {
    PyObject *lk = PyObject_GetAttr(obj, lock_name);
    if (lk == NULL) return NULL;
    PyObject *out = PyObject_CallMethodNoArgs(lk, held_acquire); /* waits without the GIL */
    if (out == NULL) {
        Py_DECREF(lk);
        return NULL;
    }
    Py_DECREF(out);
    return lk;
}

/* Release lk (and the reference); keeps an exception already set. */
static void held_unlock(PyObject *lk) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *out = PyObject_CallMethodNoArgs(lk, held_release);
    if (out == NULL) {
        PyErr_WriteUnraisable(lk); /* a lock held by us always releases */
    } else {
        Py_DECREF(out);
    }
    PyErr_Restore(type, value, tb);
    Py_DECREF(lk);
}

#endif
