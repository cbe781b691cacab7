/* One pass over a request body's JSON, compiled, for gateway/json_limits.py's check_body:
 * how deep arrays and objects nest, and whether a run of 19 or more digits (an integer that
 * may not fit a signed 64-bit int) stands outside strings. Inside a string it jumps from
 * quote to quote with memchr, so a chat body, mostly message text, costs little more than
 * reading it once. json_limits.nesting_depth and _outside_strings are the definition; the
 * unit tests hold the two to the same answers on generated bodies.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* Bump when scan() changes what it takes or returns: json_limits.py refuses a stale build
 * (an editable install does not rebuild the extension by itself). */
#define JSON_SCAN_API_VERSION 1

#define LONG_DIGIT_RUN 19 /* the shortest integer outside a signed 64-bit int */

/* The byte after the string whose opening quote is just before `p` (`end` if the string
 * is not closed): escapes are skipped, so an escaped quote does not close it. Linear in the
 * string's length however many escapes it holds: the next quote is searched for again only
 * once an escape has taken the one found. */
static const unsigned char *
skip_string(const unsigned char *p, const unsigned char *end)
{
    const unsigned char *quote = NULL;
    for (;;) {
        if (quote == NULL || quote < p) {
            quote = memchr(p, '"', (size_t)(end - p));
            if (quote == NULL) {
                return end;
            }
        }
        const unsigned char *escape = memchr(p, '\\', (size_t)(quote - p));
        if (escape == NULL) {
            return quote + 1;
        }
        p = escape + 2; /* the backslash and the byte it escapes */
        if (p >= end) {
            return end;
        }
    }
}

PyDoc_STRVAR(scan_doc,
"scan(body) -> (depth, long_number)\n\n"
"How deep JSON arrays and objects nest in `body` (brackets outside strings; 0 for none),\n"
"and whether a run of 19 or more digits stands outside its strings.");

static PyObject *
scan(PyObject *module, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    const unsigned char *p = view.buf;
    const unsigned char *end = p + view.len;
    Py_ssize_t depth = 0, deepest = 0, digits = 0;
    int long_number = 0;
    while (p < end) {
        unsigned char c = *p++;
        if (c >= '0' && c <= '9') {
            if (++digits >= LONG_DIGIT_RUN) {
                long_number = 1;
            }
            continue;
        }
        digits = 0;
        if (c == '"') {
            p = skip_string(p, end);
        }
        else if (c == '[' || c == '{') {
            if (++depth > deepest) {
                deepest = depth;
            }
        }
        else if (c == ']' || c == '}') {
            depth--;
        }
    }
    PyBuffer_Release(&view);
    return Py_BuildValue("(nN)", deepest, PyBool_FromLong(long_number));
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_O, scan_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "_json_scan",
    "One pass over a request body's JSON: nesting depth and long digit runs (json_limits.py).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__json_scan(void)
{
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(module, "API_VERSION", JSON_SCAN_API_VERSION) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
