/* Megatrace text logs (rank_<R>.log) into columns, one pass in C: the fast path of
 * rankwatch.analysis.megatrace, which keeps a numpy tokeniser for installs without this module.
 *
 * The rules are the numpy tokeniser's, byte for byte, so both give the same calls and the same
 * errors: tokens are runs of bytes other than space, tab, CR and LF; a token opens a line when
 * the byte before it is LF (or it is the first token); a line has 13 tokens (older format) or 15
 * (with groupHash), tokens 0 and 3 start with '[', 5 with 'F', 7 with 'D', 9 with 's', 11 with
 * 'o'; numbers are decimal, wrap modulo 2^64 and are read at the same places (rank: token 4 but
 * its last byte; time: token 2 as "?<sec>?<9 digits>?"; Data; opCount; groupHash with an optional
 * '-'); operation names are matched on (length, first, fourth or last, last letter) | 0x20 against
 * the table the caller passes. Error precedence is the numpy tokeniser's too: a line with a wrong
 * token count, else one with a wrong letter, else a bad number (the caller then names the line
 * with its line-by-line check), else a rank beyond 2^31 - 1 (an NCCL rank is a C int: refused,
 * never wrapped), else an unknown operation, else a bad groupHash.
 *
 * Columns come back as bytearrays the caller wraps with numpy.frombuffer (no copy). The GIL is
 * released while a buffer is tokenised, deduplicated or copied into records, so several files
 * can be read at once from a thread pool.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define MAX_TOKENS 16
#define STREAM_MIX 0x9E3779B97F4A7C15ULL /* must match megatrace.py (older format: comm from stream) */

enum { TOKENS_OK = 0, BAD_LINE = 1, BAD_NUMBER = 2, BAD_OP = 3, BAD_RANK = 4 };

/* NCCL ranks are C ints: a larger one is refused with its line, never wrapped into a wrong rank. */
#define MAX_RANK 0x7FFFFFFFULL
#define MAX_RANK_DIGITS 10

static unsigned char SEPARATOR[256];
static signed char HEX[256];

typedef struct {
    const uint8_t *buf;
    const int64_t *op_keys;
    const uint8_t *op_codes;
    Py_ssize_t n_ops;
    /* output columns, capacity: one row per line */
    int32_t *rank;
    int64_t *t_call;
    uint64_t *count, *seq, *comm;
    uint8_t *op;
    Py_ssize_t rows;
    /* first problems */
    Py_ssize_t bad_count_at, bad_letter_at, bad_op_start, bad_op_end, bad_rank_start, bad_rank_end;
    int bad_number, bad_hash, out_of_memory;
    /* older-format streams that only Python's int(x, 16) can judge: (row, start, end) triples */
    Py_ssize_t *odd;
    Py_ssize_t n_odd, odd_capacity;
} Tokens;

/* The 8 bytes before `end` as 8 decimal digits, of which the first 8 - used are taken as '0'
 * (little-endian: the first digit is the lowest byte); any other byte among the used sets *wrong. */
static inline uint64_t eight_digits(const uint8_t *end, int used, unsigned *wrong) {
    uint64_t x;
    memcpy(&x, end - 8, 8);
    uint64_t keep = ~0ULL << (8 * (8 - used)); /* used is 1..8 */
    x = (x & keep) | (0x3030303030303030ULL & ~keep);
    *wrong |= ((x & 0xF0F0F0F0F0F0F0F0ULL) != 0x3030303030303030ULL) |
              (((x + 0x0606060606060606ULL) & 0xF0F0F0F0F0F0F0F0ULL) != 0x3030303030303030ULL);
    x -= 0x3030303030303030ULL;
    x = (x * 10 + (x >> 8)) & 0x00FF00FF00FF00FFULL;
    x = (x * 100 + (x >> 16)) & 0x0000FFFF0000FFFFULL;
    return (x * 10000 + (x >> 32)) & 0xFFFFFFFFULL;
}

/* Decimal digits in [s, e); any other byte sets *bad. Wraps modulo 2^64 like the numpy version.
 * Eight digits at a time when the 8 bytes before the first chunk's end are in the buffer (from lo). */
static inline uint64_t digits(const uint8_t *lo, const uint8_t *s, const uint8_t *e, int *bad) {
    Py_ssize_t length = e - s;
    uint64_t value = 0;
    unsigned wrong = 0;
    if (length <= 0)
        return 0;
    int head = (int)((length - 1) % 8) + 1;
    if (s + head - 8 >= lo) {
        value = eight_digits(s + head, head, &wrong);
        for (s += head; s < e; s += 8)
            value = value * 100000000ULL + eight_digits(s + 8, 8, &wrong);
    } else {
        for (; s < e; s++) {
            unsigned digit = (unsigned)*s - '0';
            wrong |= digit > 9;
            value = value * 10 + digit;
        }
    }
    *bad |= (int)wrong;
    return value;
}

static int add_odd(Tokens *t, Py_ssize_t row, Py_ssize_t start, Py_ssize_t end) {
    if (t->n_odd == t->odd_capacity) {
        Py_ssize_t capacity = t->odd_capacity ? 2 * t->odd_capacity : 64;
        Py_ssize_t *grown = realloc(t->odd, (size_t)capacity * 3 * sizeof(Py_ssize_t));
        if (!grown) {
            t->out_of_memory = 1;
            return -1;
        }
        t->odd = grown;
        t->odd_capacity = capacity;
    }
    t->odd[3 * t->n_odd] = row;
    t->odd[3 * t->n_odd + 1] = start;
    t->odd[3 * t->n_odd + 2] = end;
    t->n_odd++;
    return 0;
}

/* One line of n tokens at [ts[k], te[k]). Returns 0 to go on, -1 to stop (the outcome is known). */
static int line(Tokens *t, const Py_ssize_t *ts, const Py_ssize_t *te, int n) {
    const uint8_t *b = t->buf;
    if (n != 13 && n != 15) {
        t->bad_count_at = ts[0]; /* nothing outranks the first line with a wrong token count */
        return -1;
    }
    if (t->bad_letter_at >= 0)
        return 0; /* only a wrong token count could still outrank it */
    if (b[ts[0]] != '[' || b[ts[3]] != '[' || b[ts[5]] != 'F' || b[ts[7]] != 'D' || b[ts[9]] != 's' ||
        b[ts[11]] != 'o') {
        t->bad_letter_at = ts[0];
        return 0;
    }
    Py_ssize_t row = t->rows++;
    int bad = 0;
    uint64_t rank = digits(b, b + ts[4], b + te[4] - 1, &bad);
    if ((rank > MAX_RANK || te[4] - 1 - ts[4] > MAX_RANK_DIGITS) && t->bad_rank_start < 0) {
        t->bad_rank_start = ts[4];
        t->bad_rank_end = te[4] - 1;
    }
    int32_t rank32 = (int32_t)(uint32_t)rank; /* only kept when every rank fits (else BAD_RANK) */
    Py_ssize_t length = te[2] - ts[2];
    uint64_t sec = 0, nsec = 0;
    if (length < 10) {
        bad = 1; /* numpy reads nine digits before the last byte, which then include a separator */
    } else {
        nsec = digits(b, b + te[2] - 10, b + te[2] - 1, &bad);
        if (length > 12)
            sec = digits(b, b + ts[2] + 1, b + te[2] - 11, &bad);
    }
    t->rank[row] = rank32;
    t->t_call[row] = (int64_t)(sec * 1000000000ULL + nsec);
    t->count[row] = digits(b, b + ts[8], b + te[8], &bad);
    t->seq[row] = digits(b, b + ts[12], b + te[12], &bad) + 1; /* opCount counts from 0; seq from 1 */
    t->bad_number |= bad;

    Py_ssize_t op_length = te[6] - ts[6];
    const uint8_t *name = b + ts[6];
    int64_t key = ((int64_t)op_length << 24) | ((int64_t)(name[0] | 0x20) << 16) |
                  ((int64_t)(name[op_length - 1 < 3 ? op_length - 1 : 3] | 0x20) << 8) |
                  (int64_t)(name[op_length - 1] | 0x20);
    Py_ssize_t k = 0;
    while (k < t->n_ops && t->op_keys[k] != key)
        k++;
    if (k < t->n_ops) {
        t->op[row] = t->op_codes[k];
    } else {
        t->op[row] = 0;
        if (t->bad_op_start < 0) {
            t->bad_op_start = ts[6];
            t->bad_op_end = te[6];
        }
    }

    if (n == 15) { /* groupHash, signed: two's complement */
        const uint8_t *s = b + ts[14];
        int negative = *s == '-';
        int wrong = 0;
        uint64_t magnitude = digits(b, s + negative, b + te[14], &wrong);
        t->bad_hash |= wrong;
        t->comm[row] = negative ? ~magnitude + 1 : magnitude;
    } else { /* older format: a per-rank key from the stream pointer (0 unless it is "0x...") */
        const uint8_t *s = b + ts[10], *e = b + te[10];
        uint64_t value = 0;
        if (e - s >= 2 && s[0] == '0' && s[1] == 'x') {
            int odd = e - s == 2;
            for (const uint8_t *p = s + 2; p < e && !odd; p++) {
                int h = HEX[*p];
                if (h < 0 || value >> 60) /* not a hex digit, or more than 64 bits */
                    odd = 1;
                else
                    value = (value << 4) | (uint64_t)h;
            }
            if (odd) { /* underscores, overflow, junk: Python's int() decides, as in numpy's tokeniser */
                value = 0;
                if (add_odd(t, row, ts[10], te[10]) < 0)
                    return -1;
            }
        }
        t->comm[row] = (value * STREAM_MIX) ^ (uint64_t)(int64_t)rank32;
    }
    return 0;
}

/* Bit i set: byte i of the 64 at b is a separator (space, tab, CR, LF). */
static inline uint64_t separators64(const uint8_t *b) {
#if defined(__SSE2__)
    const __m128i space = _mm_set1_epi8(' '), tab = _mm_set1_epi8('\t'), lf = _mm_set1_epi8('\n'),
                  cr = _mm_set1_epi8('\r');
    uint64_t mask = 0;
    for (int k = 0; k < 4; k++) {
        __m128i v = _mm_loadu_si128((const __m128i *)(b + 16 * k));
        __m128i separator = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, space), _mm_cmpeq_epi8(v, tab)),
                                         _mm_or_si128(_mm_cmpeq_epi8(v, lf), _mm_cmpeq_epi8(v, cr)));
        mask |= (uint64_t)(uint16_t)_mm_movemask_epi8(separator) << (16 * k);
    }
    return mask;
#else
    uint64_t mask = 0;
    for (int k = 0; k < 64; k++)
        mask |= (uint64_t)SEPARATOR[b[k]] << k;
    return mask;
#endif
}

/* Tokens from 64-byte separator masks: a token starts where a separator (or the start of the buffer)
 * is followed by another byte, and ends at the next separator (or the end of the buffer). */
static void tokenize_buffer(Tokens *t, Py_ssize_t size) {
    const uint8_t *b = t->buf;
    Py_ssize_t ts[MAX_TOKENS], te[MAX_TOKENS];
    int n = 0, inside = 0;
    uint64_t before = 1; /* bit 0: the byte before the block is a separator (none before the buffer) */
    uint8_t tail[64];
    for (Py_ssize_t base = 0; base < size; base += 64) {
        uint64_t separator;
        if (base + 64 <= size) {
            separator = separators64(b + base);
        } else { /* the last bytes, padded with separators */
            memset(tail, ' ', sizeof tail);
            memcpy(tail, b + base, (size_t)(size - base));
            separator = separators64(tail);
        }
        uint64_t changes = separator ^ ((separator << 1) | before);
        before = separator >> 63;
        while (changes) {
            Py_ssize_t at = base + __builtin_ctzll(changes);
            changes &= changes - 1;
            if (!inside) { /* a token starts at `at`; it opens a line after a LF (or as the first) */
                if (n && b[at - 1] == '\n') {
                    if (line(t, ts, te, n) < 0)
                        return;
                    n = 0;
                }
                if (n < MAX_TOKENS)
                    ts[n] = at;
            } else {
                if (n < MAX_TOKENS)
                    te[n] = at; /* at most size: the padding is made of separators */
                n++;
            }
            inside = !inside;
        }
    }
    if (inside) { /* a token up to the end of a buffer of a multiple of 64 bytes */
        if (n < MAX_TOKENS)
            te[n] = size;
        n++;
    }
    if (n)
        line(t, ts, te, n);
}

static PyObject *column(Py_ssize_t rows, size_t itemsize) {
    return PyByteArray_FromStringAndSize(NULL, rows * (Py_ssize_t)itemsize);
}

PyDoc_STRVAR(tokenize_doc,
             "tokenize(data, size, op_keys, op_codes) -> (status, start, end, rank, t_call, count, seq, op, comm, odd)\n\n"
             "Columns (bytearrays: int32, int64, uint64, uint64, uint8, uint64) of every line of a Megatrace log\n"
             "(the first `size` bytes of data, a reusable read buffer), "
             "in file order. status 0: fine; 1: the line whose first token is at byte `start` is malformed;\n"
             "2: a number is not one (check line by line); 3: unknown operation name at data[start:end];\n"
             "4: the rank at data[start:end] does not fit in 32 bits (an NCCL rank is a C int).\n"
             "odd: (row, start, end) of older-format stream pointers that only int(x, 16) can judge.\n"
             "op_keys (int64) and op_codes (uint8) are the operation table, keys as in megatrace._op_key.");

static PyObject *tokenize(PyObject *self, PyObject *args) {
    Py_buffer data, keys, codes;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "y*ny*y*:tokenize", &data, &size, &keys, &codes))
        return NULL;
    PyObject *result = NULL, *columns[6] = {NULL};
    Tokens t = {0};
    if (size < 0 || size > data.len) {
        PyErr_SetString(PyExc_ValueError, "size out of the buffer");
        goto done;
    }
    if (keys.len % 8 || keys.len / 8 != codes.len) {
        PyErr_SetString(PyExc_ValueError, "op_keys must hold one int64 per byte of op_codes");
        goto done;
    }
    t.buf = data.buf;
    t.op_keys = keys.buf;
    t.op_codes = codes.buf;
    t.n_ops = codes.len;
    t.bad_count_at = t.bad_letter_at = t.bad_op_start = t.bad_op_end = t.bad_rank_start = t.bad_rank_end = -1;

    /* Rows are kept lines of 13 or 15 tokens: 25 bytes at least. The columns are allocated for that
     * many (pages never written are never mapped), then shrunk: cheaper than counting lines first. */
    Py_ssize_t capacity = size / 25 + 1;
    static const size_t sizes[6] = {4, 8, 8, 8, 1, 8};
    for (int k = 0; k < 6; k++)
        if (!(columns[k] = column(capacity, sizes[k])))
            goto done;
    t.rank = (int32_t *)PyByteArray_AS_STRING(columns[0]);
    t.t_call = (int64_t *)PyByteArray_AS_STRING(columns[1]);
    t.count = (uint64_t *)PyByteArray_AS_STRING(columns[2]);
    t.seq = (uint64_t *)PyByteArray_AS_STRING(columns[3]);
    t.op = (uint8_t *)PyByteArray_AS_STRING(columns[4]);
    t.comm = (uint64_t *)PyByteArray_AS_STRING(columns[5]);

    Py_BEGIN_ALLOW_THREADS;
    tokenize_buffer(&t, size);
    Py_END_ALLOW_THREADS;
    if (t.out_of_memory) {
        PyErr_NoMemory();
        goto done;
    }
    for (int k = 0; k < 6; k++)
        if (PyByteArray_Resize(columns[k], t.rows * (Py_ssize_t)sizes[k]) < 0)
            goto done;

    int status = TOKENS_OK;
    Py_ssize_t start = -1, stop = -1;
    if (t.bad_count_at >= 0) {
        status = BAD_LINE;
        start = t.bad_count_at;
    } else if (t.bad_letter_at >= 0) {
        status = BAD_LINE;
        start = t.bad_letter_at;
    } else if (t.bad_number) {
        status = BAD_NUMBER;
    } else if (t.bad_rank_start >= 0) {
        status = BAD_RANK;
        start = t.bad_rank_start;
        stop = t.bad_rank_end;
    } else if (t.bad_op_start >= 0) {
        status = BAD_OP;
        start = t.bad_op_start;
        stop = t.bad_op_end;
    } else if (t.bad_hash) {
        status = BAD_NUMBER;
    }
    PyObject *odd = PyList_New(status == TOKENS_OK ? t.n_odd : 0);
    if (!odd)
        goto done;
    for (Py_ssize_t k = 0; status == TOKENS_OK && k < t.n_odd; k++) {
        PyObject *item = Py_BuildValue("(nnn)", t.odd[3 * k], t.odd[3 * k + 1], t.odd[3 * k + 2]);
        if (!item) {
            Py_DECREF(odd);
            goto done;
        }
        PyList_SET_ITEM(odd, k, item);
    }
    PyObject *head = Py_BuildValue("(inn)", status, start, stop);
    if (!head || !(result = PyTuple_New(10))) {
        Py_XDECREF(head);
        Py_DECREF(odd);
        goto done;
    }
    for (int k = 0; k < 3; k++) {
        PyObject *item = PyTuple_GET_ITEM(head, k);
        Py_INCREF(item);
        PyTuple_SET_ITEM(result, k, item);
    }
    Py_DECREF(head);
    for (int k = 0; k < 6; k++) {
        PyTuple_SET_ITEM(result, 3 + k, columns[k]); /* the tuple owns them now */
        columns[k] = NULL;
    }
    PyTuple_SET_ITEM(result, 9, odd);
done:
    for (int k = 0; k < 6; k++)
        Py_XDECREF(columns[k]);
    free(t.odd);
    PyBuffer_Release(&data);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&codes);
    return result;
}

static inline uint64_t mix(uint64_t comm, uint64_t seq, uint8_t op, uint64_t t_call) {
    uint64_t h = comm * 0x9E3779B97F4A7C15ULL;
    h = (h ^ (h >> 31) ^ seq) * 0xBF58476D1CE4E5B9ULL;
    h = (h ^ (h >> 29) ^ t_call) * 0x94D049BB133111EBULL;
    h ^= op;
    return h ^ (h >> 32);
}

PyDoc_STRVAR(first_occurrences_doc,
             "first_occurrences(rank, t_call, count, seq, op, comm) -> rows\n\n"
             "Keeps the first row of each (comm, seq, op, t_call) in file order, moving the kept rows of all six\n"
             "writable columns (as from tokenize) to the front in place; returns how many were kept.");

static PyObject *first_occurrences(PyObject *self, PyObject *args) {
    Py_buffer b[6];
    if (!PyArg_ParseTuple(args, "w*w*w*w*w*w*:first_occurrences", &b[0], &b[1], &b[2], &b[3], &b[4], &b[5]))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t rows = b[4].len;
    static const Py_ssize_t sizes[6] = {4, 8, 8, 8, 1, 8};
    for (int k = 0; k < 6; k++)
        if (b[k].len != rows * sizes[k]) {
            PyErr_SetString(PyExc_ValueError, "columns of different lengths");
            goto done;
        }
    if ((uint64_t)rows >= UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "too many rows");
        goto done;
    }
    int32_t *rank = b[0].buf;
    int64_t *t_call = b[1].buf;
    uint64_t *count = b[2].buf, *seq = b[3].buf, *comm = b[5].buf;
    uint8_t *op = b[4].buf;
    Py_ssize_t kept = 0;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS;
    /* While the kept rows have strictly increasing call times (one dump; the new part of the next
     * one), a row can only repeat the one kept row of its time: found by bisection, no table. The
     * first row that would break the order (not a repeat, yet not later) builds a hash table of
     * the kept rows, which then serves the rest of the file. */
    uint32_t *table = NULL; /* kept row + 1; 0: empty */
    size_t mask = 0;
    for (Py_ssize_t i = 0; i < rows; i++) {
        uint64_t c = comm[i], s = seq[i];
        int64_t when = t_call[i];
        uint8_t o = op[i];
        if (!table) {
            if (kept && when <= t_call[kept - 1]) {
                Py_ssize_t lo = 0, hi = kept - 1; /* the first kept row at or after `when` */
                while (lo < hi) {
                    Py_ssize_t middle = lo + (hi - lo) / 2;
                    if (t_call[middle] < when)
                        lo = middle + 1;
                    else
                        hi = middle;
                }
                if (t_call[lo] == when && comm[lo] == c && seq[lo] == s && op[lo] == o)
                    continue; /* a repeat */
                size_t slots = 16;
                while (slots < 2 * (size_t)rows)
                    slots *= 2;
                if (!(table = calloc(slots, sizeof *table))) {
                    failed = 1;
                    break;
                }
                mask = slots - 1;
                for (Py_ssize_t j = 0; j < kept; j++) {
                    size_t slot = mix(comm[j], seq[j], op[j], (uint64_t)t_call[j]) & mask;
                    while (table[slot])
                        slot = (slot + 1) & mask;
                    table[slot] = (uint32_t)j + 1;
                }
            }
        }
        if (table) {
            size_t slot = mix(c, s, o, (uint64_t)when) & mask;
            int repeat = 0;
            for (uint32_t j; (j = table[slot]) != 0; slot = (slot + 1) & mask) {
                j--;
                if (comm[j] == c && seq[j] == s && op[j] == o && t_call[j] == when) {
                    repeat = 1;
                    break;
                }
            }
            if (repeat)
                continue;
            table[slot] = (uint32_t)kept + 1;
        }
        if (kept != i) {
            rank[kept] = rank[i];
            t_call[kept] = when;
            count[kept] = count[i];
            seq[kept] = s;
            op[kept] = o;
            comm[kept] = c;
        }
        kept++;
    }
    free(table);
    Py_END_ALLOW_THREADS;
    if (failed) {
        PyErr_NoMemory();
        goto done;
    }
    result = PyLong_FromSsize_t(kept);
done:
    for (int k = 0; k < 6; k++)
        PyBuffer_Release(&b[k]);
    return result;
}

PyDoc_STRVAR(distinct_doc, "distinct(column) -> bytes\n\n"
                           "The distinct values of a uint64 column (as uint64 bytes), in order of first appearance.");

static PyObject *distinct(PyObject *self, PyObject *args) {
    Py_buffer column;
    if (!PyArg_ParseTuple(args, "y*:distinct", &column))
        return NULL;
    PyObject *result = NULL;
    if (column.len % 8) {
        PyErr_SetString(PyExc_ValueError, "not a uint64 column");
        goto done;
    }
    const uint64_t *values = column.buf;
    Py_ssize_t rows = column.len / 8, found = 0;
    size_t slots = 64;
    uint64_t *seen = malloc(slots * sizeof *seen), *table = calloc(slots, sizeof *table); /* table: index + 1 */
    int failed = !seen || !table;
    Py_BEGIN_ALLOW_THREADS;
    uint64_t last = 0;
    for (Py_ssize_t i = 0; i < rows && !failed; i++) {
        uint64_t v = values[i];
        if (found && v == last)
            continue;
        last = v;
        size_t slot = (size_t)((v * 0x9E3779B97F4A7C15ULL) >> 32) & (slots - 1);
        while (table[slot] && seen[table[slot] - 1] != v)
            slot = (slot + 1) & (slots - 1);
        if (table[slot])
            continue;
        seen[found++] = v;
        table[slot] = (uint64_t)found;
        if (2 * (size_t)found >= slots) { /* grow: rehash what was seen */
            size_t more = 2 * slots;
            uint64_t *grown = realloc(seen, more * sizeof *seen), *rehashed = calloc(more, sizeof *rehashed);
            if (grown)
                seen = grown;
            if (!grown || !rehashed) {
                free(rehashed);
                failed = 1;
                break;
            }
            for (Py_ssize_t k = 0; k < found; k++) {
                size_t at = (size_t)((seen[k] * 0x9E3779B97F4A7C15ULL) >> 32) & (more - 1);
                while (rehashed[at])
                    at = (at + 1) & (more - 1);
                rehashed[at] = (uint64_t)k + 1;
            }
            free(table);
            table = rehashed;
            slots = more;
        }
    }
    Py_END_ALLOW_THREADS;
    if (failed)
        PyErr_NoMemory();
    else
        result = PyBytes_FromStringAndSize((const char *)seen, found * 8);
    free(seen);
    free(table);
done:
    PyBuffer_Release(&column);
    return result;
}

PyDoc_STRVAR(fill_doc,
             "fill(out, template, first, columns)\n\n"
             "Writes records first, first + 1, ... of `out` (a contiguous array of records of len(template) bytes):\n"
             "each is a copy of `template` with columns = ((offset, itemsize, buffer), ...) copied in at their\n"
             "offsets, one record per element. One pass over memory instead of one per field.");

static PyObject *fill(PyObject *self, PyObject *args) {
    Py_buffer out, template;
    Py_ssize_t first;
    PyObject *spec;
    if (!PyArg_ParseTuple(args, "w*y*nO:fill", &out, &template, &first, &spec))
        return NULL;
    PyObject *result = NULL, *items = NULL;
    enum { MAX_COLUMNS = 16 };
    Py_buffer column[MAX_COLUMNS];
    Py_ssize_t offset[MAX_COLUMNS], size[MAX_COLUMNS], n = 0, rows = -1;
    Py_ssize_t itemsize = template.len;
    if (!(items = PySequence_Fast(spec, "columns must be a sequence")))
        goto done;
    if (PySequence_Fast_GET_SIZE(items) > MAX_COLUMNS) {
        PyErr_SetString(PyExc_ValueError, "too many columns");
        goto done;
    }
    for (; n < PySequence_Fast_GET_SIZE(items); n++) {
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(items, n), "nny*:fill column", &offset[n], &size[n],
                              &column[n]))
            goto done;
        Py_ssize_t s = size[n];
        if ((s != 1 && s != 2 && s != 4 && s != 8) || offset[n] < 0 || offset[n] + s > itemsize ||
            column[n].len % s || (rows >= 0 && column[n].len / s != rows)) {
            n++;
            PyErr_SetString(PyExc_ValueError, "a column does not fit the records");
            goto done;
        }
        rows = column[n].len / s;
    }
    if (rows < 0)
        rows = 0;
    if (itemsize <= 0 || first < 0 || (first + rows) * itemsize > out.len) {
        PyErr_SetString(PyExc_ValueError, "the records do not fit in out");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS;
    uint8_t *record = (uint8_t *)out.buf + first * itemsize;
    for (Py_ssize_t i = 0; i < rows; i++, record += itemsize) {
        memcpy(record, template.buf, (size_t)itemsize);
        for (Py_ssize_t k = 0; k < n; k++) {
            const uint8_t *from = (const uint8_t *)column[k].buf;
            switch (size[k]) {
            case 1: record[offset[k]] = from[i]; break;
            case 2: memcpy(record + offset[k], from + 2 * i, 2); break;
            case 4: memcpy(record + offset[k], from + 4 * i, 4); break;
            default: memcpy(record + offset[k], from + 8 * i, 8); break;
            }
        }
    }
    Py_END_ALLOW_THREADS;
    Py_INCREF(Py_None);
    result = Py_None;
done:
    for (Py_ssize_t k = 0; k < n; k++)
        PyBuffer_Release(&column[k]);
    Py_XDECREF(items);
    PyBuffer_Release(&out);
    PyBuffer_Release(&template);
    return result;
}

static PyMethodDef methods[] = {
    {"tokenize", tokenize, METH_VARARGS, tokenize_doc},
    {"first_occurrences", first_occurrences, METH_VARARGS, first_occurrences_doc},
    {"distinct", distinct, METH_VARARGS, distinct_doc},
    {"fill", fill, METH_VARARGS, fill_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_megatrace_tokenizer",
    .m_doc = "Megatrace log tokeniser (C); see rankwatch.analysis.megatrace.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__megatrace_tokenizer(void) {
    SEPARATOR[' '] = SEPARATOR['\t'] = SEPARATOR['\r'] = SEPARATOR['\n'] = 1;
    for (int c = 0; c < 256; c++)
        HEX[c] = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
    return PyModule_Create(&module);
}
