/* The kv-aware policy's pick over a table of at most FEW_ROWS replicas, compiled: the
 * scorers' costs, their weighted sum and the lowest-cost pick in one call, where the Python
 * path (router/policies/base.py Policy._sum_few, scorers.py NewPrefill._bonus_few,
 * Load.cost_few, KvPressure.cost_few, LowestCost.pick_few) makes a dozen calls and lists.
 *
 * The Python path is the definition: the same IEEE operations in the same order on each
 * row, so the same totals to the bit and the same row picked
 * (tests/unit/test_policy_few_rows.py holds the two together on random tables).
 * router/policies/kv_aware_few.py passes the table's vectors and the policy's settings.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* Bump when kv_aware_pick changes what it takes or returns: kv_aware_few.py refuses a stale
 * build (an editable install does not rebuild the extension by itself). */
#define FEW_ROWS_API_VERSION 1

#define MAX_ROWS 64 /* at least router/replica_table.py FEW_ROWS */

enum { LOAD, KV_FILL, KV_CAPACITY, ACTIVE_TOKENS, HELD_TOKENS, SHARE_RAW, NOISE, VECTORS };
static const char *const vector_names[VECTORS] = {
    "load", "kv_fill", "kv_capacity", "active_tokens", "held_tokens", "share_raw", "noise",
};

/* Whether a buffer holds at least n items of 8 bytes of the kind `kind` ('d': double, 'q':
 * int64), contiguous. */
static int
check_vector(const Py_buffer *view, Py_ssize_t n, char kind, const char *name)
{
    const char *format = view->format ? view->format : "B";
    if (format[0] == '<' || format[0] == '=' || format[0] == '@') {
        format++;
    }
    int ok = view->itemsize == 8 && view->ndim == 1 && view->len >= n * 8;
    if (kind == 'd') {
        ok = ok && format[0] == 'd' && format[1] == '\0';
    } else {
        ok = ok && (format[0] == 'q' || format[0] == 'l') && format[1] == '\0';
    }
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s: expected a vector of %zd %s", name, n,
                     kind == 'd' ? "float64" : "int64");
    }
    return ok;
}

/* `seq[i]` of a list or tuple as an int64; -1 with an exception set on error. */
static int
item_int64(PyObject *fast, Py_ssize_t i, long long *out)
{
    PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
    long long value = PyLong_AsLongLong(item);
    if (value == -1 && PyErr_Occurred()) {
        return -1;
    }
    *out = value;
    return 0;
}

PyDoc_STRVAR(kv_aware_pick_doc,
"kv_aware_pick(load, kv_fill, kv_capacity, active_tokens, held_tokens, share_raw, noise,\n"
"              kept, cached_rows, cached_tokens, prompt, tokens_per_request, kv_weight,\n"
"              capacity_tokens, use_capacity, busy, busy_rel, share_limit, share_scale,\n"
"              share_prior, share_total, min_prefix) -> row or None\n\n"
"The row the kv-aware policy picks among n = len(load) <= 64 rows (None when `kept`, a\n"
"bool vector or None for all, keeps none). Vectors are the ReplicaTable's (float64; int64\n"
"active_tokens) and the picker's tie-breaking noise; cached_rows/cached_tokens the prefix\n"
"match (lists, or None); share_limit None for no share gate. busy, busy_rel, share_prior\n"
"and share_total are NewPrefill._bonus_few's, computed by the caller.");

static PyObject *
kv_aware_pick(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 22) {
        PyErr_Format(PyExc_TypeError, "kv_aware_pick takes 22 arguments (%zd given)", nargs);
        return NULL;
    }
    Py_buffer views[VECTORS];
    int held = 0;
    Py_buffer kept_view;
    int kept_held = 0;
    PyObject *rows_fast = NULL, *tokens_fast = NULL, *result = NULL;

    for (; held < VECTORS; held++) {
        PyObject *source = held == NOISE ? args[6] : args[held];
        if (PyObject_GetBuffer(source, &views[held], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            goto done;
        }
    }
    Py_ssize_t n = views[LOAD].len / 8;
    if (n > MAX_ROWS) {
        PyErr_Format(PyExc_ValueError, "kv_aware_pick: %zd rows, at most %d", n, MAX_ROWS);
        goto done;
    }
    for (int v = 0; v < VECTORS; v++) {
        if (!check_vector(&views[v], n, v == ACTIVE_TOKENS ? 'q' : 'd', vector_names[v])) {
            goto done;
        }
    }
    const double *load = views[LOAD].buf, *kv_fill = views[KV_FILL].buf;
    const double *kv_capacity = views[KV_CAPACITY].buf, *held_tokens = views[HELD_TOKENS].buf;
    const double *share_raw = views[SHARE_RAW].buf, *noise = views[NOISE].buf;
    const int64_t *active_tokens = views[ACTIVE_TOKENS].buf;

    const unsigned char *kept = NULL;
    if (args[7] != Py_None) {
        if (PyObject_GetBuffer(args[7], &kept_view, PyBUF_C_CONTIGUOUS) < 0) {
            goto done;
        }
        kept_held = 1;
        if (kept_view.itemsize != 1 || kept_view.len < n) {
            PyErr_SetString(PyExc_TypeError, "kept: expected a bool vector of every row");
            goto done;
        }
        kept = kept_view.buf;
    }

    Py_ssize_t matched = 0;
    if (args[8] != Py_None) {
        rows_fast = PySequence_Fast(args[8], "cached_rows: expected a list");
        tokens_fast = rows_fast ? PySequence_Fast(args[9], "cached_tokens: expected a list")
                                : NULL;
        if (tokens_fast == NULL) {
            goto done;
        }
        matched = PySequence_Fast_GET_SIZE(rows_fast);
        if (PySequence_Fast_GET_SIZE(tokens_fast) != matched) {
            PyErr_SetString(PyExc_ValueError, "cached_rows and cached_tokens differ in length");
            goto done;
        }
    }
    long long match_row[MAX_ROWS], match_tokens[MAX_ROWS];
    if (matched > n) {
        PyErr_SetString(PyExc_ValueError, "cached_rows: more rows than the table has");
        goto done;
    }
    for (Py_ssize_t i = 0; i < matched; i++) {
        if (item_int64(rows_fast, i, &match_row[i]) < 0 ||
            item_int64(tokens_fast, i, &match_tokens[i]) < 0) {
            goto done;
        }
        if (match_row[i] < 0 || match_row[i] >= n) {
            PyErr_Format(PyExc_IndexError, "cached_rows: row %lld of %zd", match_row[i], n);
            goto done;
        }
    }

    long long prompt = PyLong_AsLongLong(args[10]);
    double tokens_per_request = PyFloat_AsDouble(args[11]);
    double kv_weight = PyFloat_AsDouble(args[12]);
    long long capacity_tokens = PyLong_AsLongLong(args[13]);
    int use_capacity = PyObject_IsTrue(args[14]);
    double busy = PyFloat_AsDouble(args[15]);
    double busy_rel = PyFloat_AsDouble(args[16]);
    int share_gate = args[17] != Py_None;
    double share_limit = share_gate ? PyFloat_AsDouble(args[17]) : 0.0;
    double share_scale = PyFloat_AsDouble(args[18]);
    double share_prior = PyFloat_AsDouble(args[19]);
    double share_total = PyFloat_AsDouble(args[20]);
    long long min_prefix = PyLong_AsLongLong(args[21]);
    if (PyErr_Occurred()) {
        goto done;
    }
    if (prompt < 0) {
        prompt = 0; /* max(prompt_tokens, 0) */
    }

    /* Load.cost_few, weight 1.0: the total starts from it. */
    double total[MAX_ROWS];
    for (Py_ssize_t row = 0; row < n; row++) {
        total[row] = load[row] * tokens_per_request;
    }
    /* KvPressure.cost_few, weighted; skipped at weight 0 as _sum_few skips it. */
    if (kv_weight != 0.0) {
        double fill[MAX_ROWS], cost[MAX_ROWS];
        for (Py_ssize_t row = 0; row < n; row++) {
            fill[row] = kv_fill[row];
            if (use_capacity) {
                double capacity = kv_capacity[row];
                if (capacity_tokens && !(capacity > 0)) {
                    capacity = (double)capacity_tokens;
                }
                double active = (double)active_tokens[row];
                double in_use = held_tokens[row] > active ? held_tokens[row] : active;
                double room = capacity > 0 ? in_use / capacity : 0.0;
                double fuller = room > fill[row] ? room : fill[row];
                fill[row] = 1.0 < fuller ? 1.0 : fuller;
            }
            cost[row] = fill[row] * (double)prompt;
        }
        for (Py_ssize_t i = 0; i < matched; i++) {
            long long row = match_row[i];
            long long shared = match_tokens[i] < prompt ? match_tokens[i] : prompt;
            cost[row] -= fill[row] * (double)shared;
        }
        for (Py_ssize_t row = 0; row < n; row++) {
            total[row] = total[row] + kv_weight * cost[row];
        }
    }
    /* NewPrefill._bonus_few's cache bonus (weight 1.0) on the rows past its gates. */
    for (Py_ssize_t i = 0; i < matched; i++) {
        long long row = match_row[i], tokens = match_tokens[i];
        if (tokens < min_prefix) {
            continue;
        }
        double mine = load[row];
        if (mine > busy && mine > busy_rel) {
            continue;
        }
        if (share_gate && (share_raw[row] * share_scale + share_prior) / share_total > share_limit) {
            continue;
        }
        long long bonus = tokens < prompt ? tokens : prompt;
        total[row] += 1.0 * (double)(-bonus);
    }
    /* LowestCost.pick_few: the first lowest of total + noise among kept rows. */
    Py_ssize_t best = -1;
    double best_cost = 0.0;
    for (Py_ssize_t row = 0; row < n; row++) {
        if (kept != NULL && !kept[row]) {
            continue;
        }
        double row_cost = total[row] + noise[row];
        if (best < 0 || row_cost < best_cost) {
            best = row;
            best_cost = row_cost;
        }
    }
    if (best < 0) {
        result = Py_NewRef(Py_None);
    } else {
        result = PyLong_FromSsize_t(best);
    }

done:
    Py_XDECREF(rows_fast);
    Py_XDECREF(tokens_fast);
    if (kept_held) {
        PyBuffer_Release(&kept_view);
    }
    for (int v = 0; v < held; v++) {
        PyBuffer_Release(&views[v]);
    }
    return result;
}

static PyMethodDef methods[] = {
    {"kv_aware_pick", (PyCFunction)(void (*)(void))kv_aware_pick, METH_FASTCALL,
     kv_aware_pick_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "hpcserve.router._few_rows",
    "The kv-aware policy's pick over a few rows, compiled (router/_few_rows.c).",
    -1,
    methods,
};

PyMODINIT_FUNC
PyInit__few_rows(void)
{
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(module, "API_VERSION", FEW_ROWS_API_VERSION) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
