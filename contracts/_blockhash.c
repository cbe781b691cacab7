/* Chained block hashes of token ids, compiled: the same values as the Python reference,
 * hpcserve.contracts.prefix_hash.chain_hashes_reference, i.e. h_i = hash((h_{i-1}, block_i))
 * with block_i a tuple of ints, computed without building any tuple (or, from msgpack, any
 * int). It reproduces CPython's tuple hash (Objects/tupleobject.c, xxHash-based since 3.8)
 * and int hash (Objects/longobject.c: value mod 2**61 - 1 with the sign, -1 -> -2) on a
 * 64-bit build; prefix_hash.py checks the two agree when it imports this module.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#ifdef PyHASH_BITS
#define HASH_BITS PyHASH_BITS
#else
#define HASH_BITS _PyHASH_BITS /* before 3.13 */
#endif
#if SIZEOF_VOID_P != 8 || HASH_BITS != 61
#error "hpcserve.contracts._blockhash needs a 64-bit CPython (hash modulus 2**61 - 1)"
#endif

/* Bump when the functions below change what they take or return: prefix_hash.py refuses a
 * stale build (an editable install does not rebuild the extension by itself). */
#define BLOCKHASH_API_VERSION 3

#define XXPRIME_1 ((uint64_t)11400714785074694791ULL)
#define XXPRIME_2 ((uint64_t)14029467366897019727ULL)
#define XXPRIME_5 ((uint64_t)2870177450012600261ULL)
#define XXROTATE(x) (((x) << 31) | ((x) >> 33))
#define HASH_MODULUS ((uint64_t)(((uint64_t)1 << 61) - 1))

/* hash() of a non-negative int below 2**64. */
static inline uint64_t
hash_u64(uint64_t v)
{
    uint64_t r = (v & HASH_MODULUS) + (v >> 61);
    if (r >= HASH_MODULUS) {
        r -= HASH_MODULUS;
    }
    return r; /* < 2**61 - 1, so never -1 */
}

/* hash() of a signed 64-bit int (a previous block's hash). */
static inline uint64_t
hash_i64(int64_t v)
{
    if (v >= 0) {
        return hash_u64((uint64_t)v);
    }
    int64_t r = -(int64_t)hash_u64((uint64_t)0 - (uint64_t)v);
    if (r == -1) {
        r = -2;
    }
    return (uint64_t)r;
}

static inline uint64_t
xx_round(uint64_t acc, uint64_t lane)
{
    acc += lane * XXPRIME_2;
    acc = XXROTATE(acc);
    return acc * XXPRIME_1;
}

static inline uint64_t
xx_finish(uint64_t acc, uint64_t len)
{
    acc += len ^ (XXPRIME_5 ^ 3527539UL);
    if (acc == (uint64_t)-1) {
        return 1546275796;
    }
    return acc;
}

/* hash((parent_lane's int, block)) given both lanes' hashes. */
static inline int64_t
chain_step(uint64_t parent_lane, uint64_t block_hash)
{
    uint64_t acc = XXPRIME_5;
    acc = xx_round(acc, parent_lane);
    acc = xx_round(acc, block_hash);
    return (int64_t)xx_finish(acc, 2);
}

static int
parse_block_size(PyObject *obj, Py_ssize_t *out)
{
    Py_ssize_t size = PyLong_AsSsize_t(obj);
    if (size == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (size <= 0) {
        PyErr_Format(PyExc_ValueError, "block_size must be > 0, got %zd", size);
        return -1;
    }
    *out = size;
    return 0;
}

/* The first parent's lane: hash() of whatever int the caller gave (any size, any sign). */
static int
parent_lane(PyObject *parent, uint64_t *out)
{
    if (!PyLong_Check(parent)) {
        PyErr_Format(PyExc_TypeError, "parent must be an int, not %.100s",
                     Py_TYPE(parent)->tp_name);
        return -1;
    }
    Py_hash_t h = PyObject_Hash(parent);
    if (h == -1) {
        return -1;
    }
    *out = (uint64_t)h;
    return 0;
}

PyDoc_STRVAR(chain_hashes_doc,
"chain_hashes(tokens, block_size, parent) -> list[int]\n\n"
"prefix_hash.chain_hashes_reference, compiled: the hashes of the full blocks of the\n"
"sequence `tokens`, chained from `parent`; a partial tail is left out.");

static PyObject *
chain_hashes(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "chain_hashes() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    Py_ssize_t size;
    uint64_t lane;
    if (parse_block_size(args[1], &size) < 0 || parent_lane(args[2], &lane) < 0) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "tokens must be a sequence of ints");
    if (seq == NULL) {
        return NULL;
    }
    if (seq == args[0] && PyList_Check(seq)) {
        /* The caller's own list: an item's __hash__ (anything but an int's) could change
         * it under us, so such a list is hashed from a tuple copy. */
        Py_ssize_t len = PyList_GET_SIZE(seq);
        for (Py_ssize_t i = 0; i < len; i++) {
            if (!PyLong_CheckExact(PyList_GET_ITEM(seq, i))) {
                PyObject *copy = PyList_AsTuple(seq);
                Py_DECREF(seq);
                if (copy == NULL) {
                    return NULL;
                }
                seq = copy;
                break;
            }
        }
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq) / size;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t b = 0; b < n; b++) {
        uint64_t acc = XXPRIME_5;
        PyObject **block = items + b * size;
        for (Py_ssize_t i = 0; i < size; i++) {
            Py_hash_t item = PyObject_Hash(block[i]);
            if (item == -1) {
                Py_DECREF(seq);
                Py_DECREF(out);
                return NULL;
            }
            acc = xx_round(acc, (uint64_t)item);
        }
        int64_t h = chain_step(lane, xx_finish(acc, (uint64_t)size));
        PyObject *value = PyLong_FromLongLong(h);
        if (value == NULL) {
            Py_DECREF(seq);
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, b, value);
        lane = hash_i64(h);
    }
    Py_DECREF(seq);
    return out;
}

/* --- msgpack ------------------------------------------------------------------------ */

typedef struct {
    const unsigned char *p;
    const unsigned char *end;
} Reader;

static inline uint64_t
read_be(const unsigned char *p, int width)
{
    uint64_t v = 0;
    for (int i = 0; i < width; i++) {
        v = (v << 8) | p[i];
    }
    return v;
}

/* The element count of the msgpack array at the reader; -1 with ValueError if it is not
 * one. */
static Py_ssize_t
read_array_header(Reader *r)
{
    if (r->p >= r->end) {
        PyErr_SetString(PyExc_ValueError, "token_ids: empty input, expected a msgpack array");
        return -1;
    }
    unsigned char type = *r->p++;
    uint64_t count;
    if ((type & 0xf0) == 0x90) {
        count = type & 0x0f;
    }
    else if (type == 0xdc || type == 0xdd) {
        int width = type == 0xdc ? 2 : 4;
        if (r->end - r->p < width) {
            PyErr_SetString(PyExc_ValueError, "token_ids: truncated array header");
            return -1;
        }
        count = read_be(r->p, width);
        r->p += width;
    }
    else {
        PyErr_Format(PyExc_ValueError,
                     "token_ids: expected a msgpack array, found type byte 0x%02x", type);
        return -1;
    }
    /* Every element takes at least one byte. */
    if (count > (uint64_t)(r->end - r->p)) {
        PyErr_Format(PyExc_ValueError,
                     "token_ids: the array claims %llu items but only %zd bytes follow",
                     (unsigned long long)count, (Py_ssize_t)(r->end - r->p));
        return -1;
    }
    return (Py_ssize_t)count;
}

/* One token id (a non-negative msgpack int) -> its hash() lane; -1 with ValueError. */
static inline int
read_token_lane(Reader *r, Py_ssize_t index, uint64_t *lane)
{
    if (r->p >= r->end) {
        PyErr_Format(PyExc_ValueError, "token_ids: truncated at item %zd", index);
        return -1;
    }
    unsigned char type = *r->p++;
    if (type < 0x80) { /* positive fixint */
        *lane = type;
        return 0;
    }
    int width;
    int is_signed = 0;
    switch (type) {
    case 0xcc: width = 1; break;
    case 0xcd: width = 2; break;
    case 0xce: width = 4; break;
    case 0xcf: width = 8; break;
    case 0xd0: width = 1; is_signed = 1; break;
    case 0xd1: width = 2; is_signed = 1; break;
    case 0xd2: width = 4; is_signed = 1; break;
    case 0xd3: width = 8; is_signed = 1; break;
    default:
        if (type >= 0xe0) {
            PyErr_Format(PyExc_ValueError, "token_ids: item %zd is negative (%d)", index,
                         (int)(signed char)type);
        }
        else {
            PyErr_Format(PyExc_ValueError,
                         "token_ids: item %zd is not an integer (msgpack type byte 0x%02x)",
                         index, type);
        }
        return -1;
    }
    if (r->end - r->p < width) {
        PyErr_Format(PyExc_ValueError, "token_ids: truncated at item %zd", index);
        return -1;
    }
    uint64_t v = read_be(r->p, width);
    r->p += width;
    /* A signed encoding of a non-negative value is fine; a negative value is not. */
    if (is_signed && (v >> (width * 8 - 1)) & 1) {
        int64_t neg = (int64_t)(v | (width == 8 ? 0 : ~(uint64_t)0 << (width * 8)));
        PyErr_Format(PyExc_ValueError, "token_ids: item %zd is negative (%lld)", index,
                     (long long)neg);
        return -1;
    }
    *lane = hash_u64(v);
    return 0;
}

static int
get_buffer(PyObject *obj, Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "token_ids must be msgpack bytes (bytes, memoryview, msgspec.Raw), "
                     "not %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(chain_hashes_msgpack_doc,
"chain_hashes_msgpack(token_ids, block_size, parent, max_blocks=-1) -> list[int]\n\n"
"chain_hashes of the msgpack array of non-negative ints in the buffer `token_ids` (e.g.\n"
"the msgspec.Raw of a BlockStored event's field), at most `max_blocks` blocks (-1: all).\n"
"Every item is checked, including those past the last block hashed. ValueError names the\n"
"problem when the buffer is not exactly one such array.");

/* The hashes of at most `max_blocks` (-1: all) full blocks of the msgpack array in
 * `token_ids`, chained from the lane `lane`; NULL with ValueError when the buffer is not
 * exactly one array of non-negative ints (every item is checked). */
static PyObject *
hash_msgpack_blocks(PyObject *token_ids, Py_ssize_t size, uint64_t lane, Py_ssize_t max_blocks)
{
    Py_buffer view;
    if (get_buffer(token_ids, &view) < 0) {
        return NULL;
    }
    Reader r = {(const unsigned char *)view.buf, (const unsigned char *)view.buf + view.len};
    PyObject *out = NULL;
    Py_ssize_t count = read_array_header(&r);
    if (count < 0) {
        goto done;
    }
    Py_ssize_t n = count / size;
    if (max_blocks >= 0 && n > max_blocks) {
        n = max_blocks;
    }
    out = PyList_New(n);
    if (out == NULL) {
        goto done;
    }
    Py_ssize_t index = 0;
    for (Py_ssize_t b = 0; b < n; b++) {
        uint64_t acc = XXPRIME_5, item;
        for (Py_ssize_t i = 0; i < size; i++, index++) {
            if (read_token_lane(&r, index, &item) < 0) {
                Py_CLEAR(out);
                goto done;
            }
            acc = xx_round(acc, item);
        }
        int64_t h = chain_step(lane, xx_finish(acc, (uint64_t)size));
        PyObject *value = PyLong_FromLongLong(h);
        if (value == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, b, value);
        lane = hash_i64(h);
    }
    for (uint64_t ignored; index < count; index++) {
        if (read_token_lane(&r, index, &ignored) < 0) {
            Py_CLEAR(out);
            goto done;
        }
    }
    if (r.p != r.end) {
        PyErr_Format(PyExc_ValueError, "token_ids: %zd bytes after the array",
                     (Py_ssize_t)(r.end - r.p));
        Py_CLEAR(out);
    }
done:
    PyBuffer_Release(&view);
    return out;
}

static PyObject *
chain_hashes_msgpack(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3 && nargs != 4) {
        PyErr_Format(PyExc_TypeError,
                     "chain_hashes_msgpack() takes 3 or 4 arguments (%zd given)", nargs);
        return NULL;
    }
    Py_ssize_t size, max_blocks = -1;
    uint64_t lane;
    if (parse_block_size(args[1], &size) < 0 || parent_lane(args[2], &lane) < 0) {
        return NULL;
    }
    if (nargs == 4) {
        max_blocks = PyLong_AsSsize_t(args[3]);
        if (max_blocks == -1 && PyErr_Occurred()) {
            return NULL;
        }
    }
    return hash_msgpack_blocks(args[0], size, lane, max_blocks);
}

/* holders[h] = bit if absent, else holders[h] | bit (kept when it is `bit` itself, so a
 * block held by one replica shares the slot's cached int); -1 with an exception set. */
static int
add_holder(PyObject *holders, PyObject *h, PyObject *bit)
{
    PyObject *old = PyDict_SetDefault(holders, h, bit); /* borrowed */
    if (old == NULL) {
        return -1;
    }
    if (old == bit) {
        return 0;
    }
    PyObject *mask = PyNumber_Or(old, bit);
    if (mask == NULL) {
        return -1;
    }
    int failed = PyDict_SetItem(holders, h, mask);
    Py_DECREF(mask);
    return failed;
}

PyDoc_STRVAR(store_msgpack_blocks_doc,
"store_msgpack_blocks(token_ids, block_size, parent, block_hashes, engine, holders, bit)\n"
"-> list[int]\n\n"
"PrefixIndex.stored's work for one BlockStored event, compiled. Hashes the blocks as\n"
"chain_hashes_msgpack(token_ids, block_size, parent, len(block_hashes)) does (ValueError,\n"
"nothing changed, when token_ids is not a msgpack array of non-negative ints) and returns\n"
"them; when there are as many as `block_hashes` (a list), then for each block:\n"
"engine[block_hash] = ours, and holders[ours] = bit if absent, else holders[ours] | bit\n"
"(the value already there kept when it is `bit` itself). With fewer, nothing is stored.");

static PyObject *
store_msgpack_blocks(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError,
                     "store_msgpack_blocks() takes 7 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *block_hashes = args[3], *engine = args[4], *holders = args[5], *bit = args[6];
    if (!PyList_Check(block_hashes)) {
        PyErr_Format(PyExc_TypeError, "block_hashes must be a list, not %.100s",
                     Py_TYPE(block_hashes)->tp_name);
        return NULL;
    }
    if (!PyDict_CheckExact(engine) || !PyDict_CheckExact(holders)) {
        PyErr_SetString(PyExc_TypeError, "engine and holders must be dicts");
        return NULL;
    }
    Py_ssize_t size;
    uint64_t lane;
    if (parse_block_size(args[1], &size) < 0 || parent_lane(args[2], &lane) < 0) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(block_hashes);
    PyObject *ours = hash_msgpack_blocks(args[0], size, lane, n);
    if (ours == NULL || PyList_GET_SIZE(ours) < n) {
        return ours;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        /* A block hash's __eq__/__hash__ (bytes or int from the decoder) cannot change
         * the list, but take our own references anyway. */
        PyObject *key = PyList_GET_ITEM(block_hashes, i);
        PyObject *h = PyList_GET_ITEM(ours, i);
        Py_INCREF(key);
        int failed = PyDict_SetItem(engine, key, h);
        Py_DECREF(key);
        if (failed < 0) {
            goto error;
        }
        if (add_holder(holders, h, bit) < 0) {
            goto error;
        }
    }
    return ours;
error:
    Py_DECREF(ours);
    return NULL;
}

PyDoc_STRVAR(array_length_doc,
"array_length(token_ids) -> int\n\n"
"The item count of the msgpack array in the buffer `token_ids` (its header only).");

static PyObject *
array_length(PyObject *module, PyObject *arg)
{
    (void)module;
    Py_buffer view;
    if (get_buffer(arg, &view) < 0) {
        return NULL;
    }
    Reader r = {(const unsigned char *)view.buf, (const unsigned char *)view.buf + view.len};
    Py_ssize_t count = read_array_header(&r);
    PyBuffer_Release(&view);
    return count < 0 ? NULL : PyLong_FromSsize_t(count);
}

PyDoc_STRVAR(mask_run_doc,
"mask_run(holders, hashes, start, alive) -> int\n\n"
"PrefixIndex.match_slots's walk, compiled: the first index i >= start of the list `hashes`\n"
"whose holder mask (holders.get(hashes[i], 0)) drops a bit of `alive` (a non-zero int), or\n"
"len(hashes) when none does. A mask that is `alive`, equals it, or (both within 64 bits)\n"
"holds every bit of it keeps the walk going; a wider one that differs stops it, and the\n"
"caller decides.");

static PyObject *
mask_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "mask_run() takes 4 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *holders = args[0], *hashes = args[1], *alive = args[3];
    if (!PyDict_CheckExact(holders) || !PyList_Check(hashes) || !PyLong_Check(alive)) {
        PyErr_SetString(PyExc_TypeError, "mask_run() takes (dict, list, int, int)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[2]);
    if (start == -1 && PyErr_Occurred()) {
        return NULL;
    }
    /* Within 64 bits, masks compare as machine words; a wider `alive` only by identity or
     * equality (an index of more than 64 replicas: the caller's Python handles the rest). */
    unsigned long long want = PyLong_AsUnsignedLongLong(alive);
    int narrow = !(want == (unsigned long long)-1 && PyErr_Occurred());
    if (!narrow) {
        PyErr_Clear();
    }
    Py_ssize_t n = PyList_GET_SIZE(hashes);
    if (start < 0) {
        start = 0;
    }
    for (Py_ssize_t i = start; i < n; i++) {
        PyObject *h = PyList_GET_ITEM(hashes, i);
        Py_INCREF(h);
        PyObject *mask = PyDict_GetItemWithError(holders, h); /* borrowed */
        Py_DECREF(h);
        if (mask == alive) {
            continue;
        }
        if (mask == NULL) {
            if (PyErr_Occurred()) {
                return NULL;
            }
            return PyLong_FromSsize_t(i);
        }
        if (narrow && PyLong_Check(mask)) {
            unsigned long long have = PyLong_AsUnsignedLongLong(mask);
            if (have == (unsigned long long)-1 && PyErr_Occurred()) {
                PyErr_Clear(); /* wider than 64 bits (or negative): the caller's */
                return PyLong_FromSsize_t(i);
            }
            if ((have & want) == want) {
                continue;
            }
            return PyLong_FromSsize_t(i);
        }
        int same = PyObject_RichCompareBool(mask, alive, Py_EQ);
        if (same < 0) {
            return NULL;
        }
        if (!same) {
            return PyLong_FromSsize_t(i);
        }
    }
    return PyLong_FromSsize_t(n);
}

PyDoc_STRVAR(note_blocks_doc,
"note_blocks(recent, holders, hashes, start, expires, bit, renew_before) -> None\n\n"
"RoutedPrefixes.routed's work, compiled: for each hash of the list `hashes` from `start`:\n"
"one not in `recent` (an OrderedDict: hash -> expiry) gets holders[h] = bit if absent, else\n"
"holders[h] | bit (kept when it is `bit` itself), and recent[h] = expires (at the end); one\n"
"in it expiring before `renew_before` gets recent[h] = expires (in its place); one expiring\n"
"later is left as it is (a hot prefix is not rewritten on every request).");

static PyObject *
note_blocks(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "note_blocks() takes 7 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *recent = args[0], *holders = args[1], *hashes = args[2], *expires = args[4];
    PyObject *bit = args[5];
    double renew_before = PyFloat_AsDouble(args[6]);
    if (renew_before == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    if (!PyDict_Check(recent) || !PyDict_CheckExact(holders) || !PyList_Check(hashes)) {
        PyErr_SetString(PyExc_TypeError,
                        "note_blocks() takes (OrderedDict, dict, list, int, float, int, float)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[3]);
    if (start == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (start < 0) {
        start = 0;
    }
    PyObject *h = NULL;
    for (Py_ssize_t i = start; i < PyList_GET_SIZE(hashes); i++) {
        h = PyList_GET_ITEM(hashes, i);
        Py_INCREF(h);
        PyObject *until = PyDict_GetItemWithError(recent, h); /* borrowed */
        if (until == NULL && PyErr_Occurred()) {
            goto error;
        }
        if (until != NULL) {
            if (PyFloat_Check(until) && PyFloat_AS_DOUBLE(until) >= renew_before) {
                Py_DECREF(h);
                continue;
            }
        }
        else {
            if (add_holder(holders, h, bit) < 0) {
                goto error;
            }
        }
        /* PyObject_SetItem, not PyDict_SetItem: an OrderedDict keeps its order itself. */
        if (PyObject_SetItem(recent, h, expires) < 0) {
            goto error;
        }
        Py_DECREF(h);
    }
    Py_RETURN_NONE;
error:
    Py_XDECREF(h);
    return NULL;
}

static PyMethodDef methods[] = {
    {"chain_hashes", (PyCFunction)(void (*)(void))chain_hashes, METH_FASTCALL,
     chain_hashes_doc},
    {"chain_hashes_msgpack", (PyCFunction)(void (*)(void))chain_hashes_msgpack,
     METH_FASTCALL, chain_hashes_msgpack_doc},
    {"store_msgpack_blocks", (PyCFunction)(void (*)(void))store_msgpack_blocks,
     METH_FASTCALL, store_msgpack_blocks_doc},
    {"array_length", array_length, METH_O, array_length_doc},
    {"mask_run", (PyCFunction)(void (*)(void))mask_run, METH_FASTCALL, mask_run_doc},
    {"note_blocks", (PyCFunction)(void (*)(void))note_blocks, METH_FASTCALL, note_blocks_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "_blockhash",
    "Chained block hashes of token ids (prefix_hash.py's, compiled).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__blockhash(void)
{
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(module, "API_VERSION", BLOCKHASH_API_VERSION) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
