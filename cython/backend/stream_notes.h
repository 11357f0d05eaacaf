/* The acl backend's notes of the streams it created (acl.c), found by handle through a hash index.
 *
 * Every call on a stream asks whether the backend created it (acl_enter_stream), under the
 * backend's one streams_lock: a scan of the notes made each such call (an event record on a free,
 * a wait, a query) cost time linear in the streams of every device of the process, held under that
 * lock by every thread (30,000 streams on 16 devices: 28 us per record_stream + free instead of
 * 0.8). The index is open addressing with linear probing over the notes' positions; removal
 * shifts the probe run back (no tombstones) and the index halves as the notes go, so a process
 * that creates and destroys streams for ever keeps it within eight times its live notes (64 at
 * least). Not thread-safe: the caller holds streams_lock.
 */
#ifndef ASCEND_POOL_STREAM_NOTES_H
#define ASCEND_POOL_STREAM_NOTES_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

struct acl_stream_dev {
    void *stream;
    int device;
    uint64_t serial; /* which note: a handle the runtime reused gets a new one */
    int suspect;     /* a call on it was refused as for an unknown handle: asked at the next check */
};

typedef struct acl_stream_notes {
    struct acl_stream_dev *v; /* the notes, in no order; handles are unique */
    size_t n, cap;
    size_t *index;            /* power-of-two table: a note's position + 1, 0 empty */
    size_t index_cap;         /* 0, or more than twice n */
} acl_stream_notes;

static inline size_t notes_hash(const void *stream)
{
    uint64_t x = (uint64_t)(uintptr_t)stream;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return (size_t)x;
}

/* The index position holding `stream`, or the empty one its probe run ends at. index_cap > 0. */
static inline size_t notes_probe(const acl_stream_notes *t, const void *stream)
{
    size_t mask = t->index_cap - 1, h = notes_hash(stream) & mask;
    while (t->index[h] && t->v[t->index[h] - 1].stream != stream)
        h = (h + 1) & mask;
    return h;
}

/* The position of the note of `stream`, or -1. */
static inline ptrdiff_t notes_find(const acl_stream_notes *t, const void *stream)
{
    if (!t->index_cap)
        return -1;
    size_t at = t->index[notes_probe(t, stream)];
    return at ? (ptrdiff_t)at - 1 : -1;
}

static inline int notes_reindex(acl_stream_notes *t, size_t cap)
{
    size_t *index = calloc(cap, sizeof *index);
    if (!index)
        return -1;
    free(t->index);
    t->index = index;
    t->index_cap = cap;
    for (size_t i = 0; i < t->n; i++)
        t->index[notes_probe(t, t->v[i].stream)] = i + 1;
    return 0;
}

/* Appends a note whose handle has none. 0, or -1 out of host memory (nothing changed). */
static inline int notes_append(acl_stream_notes *t, struct acl_stream_dev note)
{
    if (t->n == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 16;
        struct acl_stream_dev *v = realloc(t->v, cap * sizeof *v);
        if (!v)
            return -1;
        t->v = v;
        t->cap = cap;
    }
    if ((t->n + 1) * 2 >= t->index_cap && notes_reindex(t, t->index_cap ? t->index_cap * 2 : 32) != 0)
        return -1;
    t->v[t->n] = note;
    t->index[notes_probe(t, note.stream)] = t->n + 1;
    t->n++;
    return 0;
}

/* Removes the note at position i; the last note takes its place. */
static inline void notes_remove_at(acl_stream_notes *t, size_t i)
{
    size_t mask = t->index_cap - 1, h = notes_probe(t, t->v[i].stream), j = h;

    t->index[h] = 0;
    for (;;) { /* shift back each later entry of the run whose home is not between h and it */
        j = (j + 1) & mask;
        if (!t->index[j])
            break;
        size_t home = notes_hash(t->v[t->index[j] - 1].stream) & mask;
        if (h <= j ? (home <= h || home > j) : (home <= h && home > j)) {
            t->index[h] = t->index[j];
            t->index[j] = 0;
            h = j;
        }
    }
    size_t last = t->n - 1;
    if (i != last) {
        t->index[notes_probe(t, t->v[last].stream)] = i + 1;
        t->v[i] = t->v[last];
    }
    t->n--;
    /* Shrinks with the notes, so that the index of a process past a peak of streams stays small. */
    if (t->index_cap > 64 && t->n * 8 < t->index_cap)
        (void)notes_reindex(t, t->index_cap / 2);
}

static inline void notes_free(acl_stream_notes *t)
{
    free(t->v);
    free(t->index);
    *t = (acl_stream_notes){0};
}

#endif
