/* Passes over a request body's JSON, compiled. Inside a string each jumps from quote to
 * quote with memchr, so a chat body, mostly message text, costs little more than reading it
 * once.
 *
 * scan: for gateway/json_limits.py's check_body, how deep arrays and objects nest, and
 * whether a run of 19 or more digits (an integer that may not fit a signed 64-bit int)
 * stands outside strings. json_limits.nesting_depth and _outside_strings are the
 * definition; the unit tests hold the two to the same answers on generated bodies.
 *
 * message_spans: for the prefix hints (gateway/route_hints.py body_hints), where each of a
 * chat body's messages lies and a keyed hash of the bytes of the messages up to it, so that
 * the prompt cache finds the longest prefix it holds without decoding the body.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Bump when scan() changes what it takes or returns: json_limits.py refuses a stale build
 * (an editable install does not rebuild the extension by itself). */
#define JSON_SCAN_API_VERSION 2

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

static inline const unsigned char *
skip_space(const unsigned char *p, const unsigned char *end)
{
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) {
        p++;
    }
    return p;
}

/* The byte after the JSON value that starts at `p`, or NULL when it does not end before
 * `end` (a complete body's values are all followed by something). */
static const unsigned char *
skip_value(const unsigned char *p, const unsigned char *end)
{
    if (p >= end) {
        return NULL;
    }
    if (*p == '"') {
        p = skip_string(p + 1, end);
        return p < end ? p : NULL;
    }
    if (*p == '{' || *p == '[') {
        Py_ssize_t depth = 0;
        while (p < end) {
            unsigned char c = *p++;
            if (c == '"') {
                p = skip_string(p, end);
            }
            else if (c == '[' || c == '{') {
                depth++;
            }
            else if ((c == ']' || c == '}') && --depth == 0) {
                return p < end ? p : NULL;
            }
        }
        return NULL;
    }
    while (p < end && *p != ',' && *p != '}' && *p != ']' && *p != ' ' && *p != '\t' &&
           *p != '\n' && *p != '\r') {
        p++;
    }
    return p < end ? p : NULL;
}

static int
is_key(const unsigned char *key, Py_ssize_t len, const char *name)
{
    return len == (Py_ssize_t)strlen(name) && memcmp(key, name, (size_t)len) == 0;
}

/* Whether a value (its bytes) is null or an empty array: a "tools" the template never sees. */
static int
is_nothing(const unsigned char *p, const unsigned char *end)
{
    if (end - p == 4 && memcmp(p, "null", 4) == 0) {
        return 1;
    }
    return *p == '[' && *skip_space(p + 1, end) == ']';
}

/* The keyed hash of a message's bytes after `seed` (the key of the messages before it, 0
 * for the first): 16 bytes a step, each step a 64x64->128-bit multiply folded to 64 bits
 * (as wyhash mixes), from a secret drawn at import. Not a defence against an attacker who
 * knows the secret: a collision makes two prompts share cached hints, that is, routing on
 * the wrong prefix, never a wrong answer or another tenant's data (each adapter and cache
 * salt has its own root). */
static uint64_t message_secret[4];

static inline uint64_t
fold_multiply(uint64_t a, uint64_t b)
{
    __uint128_t product = (__uint128_t)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
}

static uint64_t
message_hash(const unsigned char *p, size_t n, uint64_t seed)
{
    uint64_t h = message_secret[0] ^ fold_multiply(n ^ seed ^ message_secret[1], message_secret[2]);
    uint64_t a, b;
    for (; n > 16; p += 16, n -= 16) {
        memcpy(&a, p, 8);
        memcpy(&b, p + 8, 8);
        h = fold_multiply(a ^ message_secret[1] ^ h, b ^ message_secret[2]);
    }
    unsigned char last[16] = {0};
    memcpy(last, p, n);
    memcpy(&a, last, 8);
    memcpy(&b, last + 8, 8);
    h = fold_multiply(a ^ message_secret[1] ^ h, b ^ message_secret[2]);
    return fold_multiply(h ^ message_secret[3], message_secret[0] ^ n);
}

typedef struct {
    Py_ssize_t start, stop;
} Span;

/* The items of the JSON array at `p` (just after its '[') as spans from `begin`, appended to
 * `*spans` (grown with PyMem_Realloc); the byte after the array, or NULL when an item is not
 * an object or the array is empty or cut short (MemoryError set only when out of memory). */
static const unsigned char *
object_items(const unsigned char *p, const unsigned char *end, const unsigned char *begin,
             Span **spans, Py_ssize_t *count, Py_ssize_t *room)
{
    p = skip_space(p, end);
    while (p < end && *p == '{') {
        const unsigned char *stop = skip_value(p, end);
        if (stop == NULL) {
            return NULL;
        }
        if (*count == *room) {
            Py_ssize_t more = *room ? *room * 2 : 16;
            Span *grown = PyMem_Realloc(*spans, (size_t)more * sizeof(Span));
            if (grown == NULL) {
                PyErr_NoMemory();
                return NULL;
            }
            *spans = grown;
            *room = more;
        }
        (*spans)[(*count)++] = (Span){p - begin, stop - begin};
        p = skip_space(stop, end);
        if (p < end && *p == ',') {
            p = skip_space(p + 1, end);
            continue;
        }
        return p < end && *p == ']' ? p + 1 : NULL;
    }
    return NULL;
}

/* The spans of the items of the top-level "messages" array of a JSON object (0 items when
 * the body is no such object, names it twice, has a "tools" that is neither null nor [],
 * or has a key written with an escape: it may spell either name); -1 when out of memory. */
static Py_ssize_t
find_messages(const unsigned char *begin, const unsigned char *end, Span **spans)
{
    Py_ssize_t count = 0, room = 0;
    int found = 0;
    const unsigned char *p = skip_space(begin, end);
    if (p >= end || *p != '{') {
        return 0;
    }
    p = skip_space(p + 1, end);
    for (;;) {
        if (p >= end || *p != '"') {
            return 0;
        }
        const unsigned char *key = p + 1;
        const unsigned char *after = skip_string(key, end);
        if (after >= end || memchr(key, '\\', (size_t)(after - 1 - key)) != NULL) {
            return 0;
        }
        Py_ssize_t key_len = after - 1 - key;
        p = skip_space(after, end);
        if (p >= end || *p != ':') {
            return 0;
        }
        const unsigned char *value = skip_space(p + 1, end);
        const unsigned char *value_end;
        if (is_key(key, key_len, "messages")) {
            if (found || value >= end || *value != '[') {
                return 0;
            }
            found = 1;
            value_end = object_items(value + 1, end, begin, spans, &count, &room);
            if (value_end == NULL) {
                return PyErr_Occurred() ? -1 : 0;
            }
        }
        else {
            value_end = skip_value(value, end);
            if (value_end == NULL ||
                (is_key(key, key_len, "tools") && !is_nothing(value, value_end))) {
                return 0;
            }
        }
        p = skip_space(value_end, end);
        if (p < end && *p == ',') {
            p = skip_space(p + 1, end);
            continue;
        }
        return p < end && *p == '}' ? count : 0;
    }
}

PyDoc_STRVAR(message_spans_doc,
"message_spans(body) -> list[tuple[int, int, int]] | None\n\n"
"For each item of the \"messages\" array of the JSON object `body`: (key, start, stop), where\n"
"body[start:stop] is the item and key a hash of the bytes of the items up to it and this one\n"
"(the key of the prompt's prefix that ends with it), keyed by a secret drawn when the module\n"
"is imported. None when an item is not an object, or the body is not a JSON\n"
"object whose keys are written without escapes and name \"messages\" (a non-empty array)\n"
"once and \"tools\" only as null or [].");

static PyObject *
message_spans(PyObject *module, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    const unsigned char *begin = view.buf;
    Span *spans = NULL;
    PyObject *out = NULL;
    Py_ssize_t count = find_messages(begin, begin + view.len, &spans);
    if (count < 0) {
        goto done;
    }
    if (count == 0) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    out = PyList_New(count);
    uint64_t key = 0;
    for (Py_ssize_t i = 0; out != NULL && i < count; i++) {
        Span span = spans[i];
        key = message_hash(begin + span.start, (size_t)(span.stop - span.start), key);
        PyObject *item = PyTuple_New(3);
        PyObject *fields[3] = {PyLong_FromLongLong((long long)key),
                               PyLong_FromSsize_t(span.start), PyLong_FromSsize_t(span.stop)};
        if (item == NULL || !fields[0] || !fields[1] || !fields[2]) {
            Py_XDECREF(item);
            Py_XDECREF(fields[0]);
            Py_XDECREF(fields[1]);
            Py_XDECREF(fields[2]);
            Py_CLEAR(out);
            break;
        }
        for (int f = 0; f < 3; f++) {
            PyTuple_SET_ITEM(item, f, fields[f]);
        }
        PyList_SET_ITEM(out, i, item);
    }
done:
    PyMem_Free(spans);
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_O, scan_doc},
    {"message_spans", message_spans, METH_O, message_spans_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "_json_scan",
    "Passes over a request body's JSON: nesting depth and long digit runs (json_limits.py), "
    "where a chat body's messages lie (prefix hints).",
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
    PyObject *os = PyImport_ImportModule("os");
    PyObject *secret = os ? PyObject_CallMethod(os, "urandom", "n", (Py_ssize_t)sizeof(message_secret)) : NULL;
    Py_XDECREF(os);
    if (secret == NULL || !PyBytes_Check(secret) ||
        PyBytes_GET_SIZE(secret) != (Py_ssize_t)sizeof(message_secret)) {
        Py_XDECREF(secret);
        Py_DECREF(module);
        return NULL;
    }
    memcpy(message_secret, PyBytes_AS_STRING(secret), sizeof(message_secret));
    Py_DECREF(secret);
    for (int i = 0; i < 4; i++) {
        message_secret[i] |= 1; /* an odd multiplier is never zero */
    }
    return module;
}
