/* Block, segment and record_stream structs come from chunks and are recycled, so the cached path
 * never calls malloc (a split needs a new block struct, a merge returns one).
 *
 * In ASan builds a spare struct is poisoned past its link word, so code that still reads a block
 * after merging it away (or a segment after releasing it) is reported where it does so, as a
 * use-after-free would be with malloc. */
#include <stdlib.h>
#include <string.h>

#include "pool_internal.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define SPARE_POISON(x, size) ASAN_POISON_MEMORY_REGION((char *)(x) + sizeof(void *), (size) - sizeof(void *))
#define SPARE_UNPOISON(x, size) ASAN_UNPOISON_MEMORY_REGION((x), (size))
#else
#define SPARE_POISON(x, size) ((void)(x), (void)(size))
#define SPARE_UNPOISON(x, size) ((void)(x), (void)(size))
#endif

#define CHUNK_STRUCTS 256

static void *new_chunk(ap_pool *p, size_t bytes) {
    if (p->n_chunks == p->chunks_cap) {
        size_t cap = p->chunks_cap ? p->chunks_cap * 2 : 16;
        void **c = realloc(p->chunks, cap * sizeof *c);
        if (!c) return NULL;
        p->chunks = c;
        p->chunks_cap = cap;
    }
    void *chunk = calloc(1, bytes);
    if (chunk) p->chunks[p->n_chunks++] = chunk;
    return chunk;
}

/* Zeroing a struct: GCC turns memset (and a plain loop) of these sizes into `rep stos`, whose
   start-up cost was most of the cost of a new block struct, about 8 % of a cached malloc/free
   pair that splits and merges (perf, AMD EPYC). Word stores that it may not turn back into
   memset compile to a few vector stores instead; other compilers inline memset well. */
#if defined(__GNUC__) && !defined(__clang__)
#define AP_ZEROING __attribute__((optimize("no-tree-loop-distribute-patterns")))
#else
#define AP_ZEROING
#endif

static inline __attribute__((always_inline)) AP_ZEROING void zero_struct(void *x, size_t size) {
    uint64_t *w = x;
    for (size_t i = 0; i < size / sizeof *w; i++) w[i] = 0;
}

/* A zeroed struct of `size` bytes (a multiple of 8) from the spare list, carving a new chunk when
   it is empty. A spare struct holds nothing else, so its first word links it (copied with memcpy:
   no aliasing). Inlined into each caller, so that the size is a constant there. */
static inline __attribute__((always_inline)) AP_ZEROING void *take(ap_pool *p, void **spare, size_t size) {
    if (!*spare) {
        char *chunk = new_chunk(p, CHUNK_STRUCTS * size);
        if (!chunk) return NULL;
        for (int i = CHUNK_STRUCTS - 1; i >= 0; i--) {
            memcpy(chunk + (size_t)i * size, spare, sizeof(void *));
            SPARE_POISON(chunk + (size_t)i * size, size);
            *spare = chunk + (size_t)i * size;
        }
    }
    void *x = *spare;
    memcpy(spare, x, sizeof(void *));
    SPARE_UNPOISON(x, size);
    zero_struct(x, size);
    return x;
}

static void give(void **spare, void *x, size_t size) {
    AP_ASSERT(x != NULL && x != *spare); /* a struct is given back once */
    memcpy(x, spare, sizeof(void *));
    SPARE_POISON(x, size);
    *spare = x;
}

_Static_assert(sizeof(ap_block) % 8 == 0 && sizeof(ap_segment) % 8 == 0 && sizeof(ap_block_uses) % 8 == 0,
               "zero_struct clears whole words");

AP_ZEROING ap_block *ap_block_new(ap_pool *p) { return take(p, &p->spare_blocks, sizeof(ap_block)); }

void ap_block_recycle(ap_pool *p, ap_block *b) { give(&p->spare_blocks, b, sizeof(ap_block)); }

AP_ZEROING ap_segment *ap_segment_new(ap_pool *p) {
    ap_segment *s = take(p, &p->spare_segments, sizeof(ap_segment));
    if (s) s->seq = ++p->segment_seq;
    return s;
}

void ap_segment_recycle(ap_pool *p, ap_segment *s) { give(&p->spare_segments, s, sizeof(ap_segment)); }

/* u's arrays back at its inline ones (a new struct, or a grown one given back). */
static void uses_inline(ap_block_uses *u) {
    u->cap = AP_MAX_USES;
    u->fcap = AP_MAX_FOREIGN;
    u->uses = u->uses_in;
    u->events = u->events_in;
    u->event_keys = u->event_keys_in;
    u->owed = u->owed_in;
    u->foreign = u->foreign_in;
    u->foreign_device = u->foreign_device_in;
    u->fevents = u->fevents_in;
}

AP_ZEROING ap_block_uses *ap_uses_new(ap_pool *p) {
    ap_block_uses *u = take(p, &p->spare_uses, sizeof(ap_block_uses));
    if (u) uses_inline(u);
    return u;
}

/* Room for twice the uses (foreign: 0, at most one per stream slot) or twice the streams of other
   devices (foreign: 1, at most AP_FOREIGN_LIMIT), in one heap allocation holding every array:
   only a block marked with more than AP_MAX_USES streams of its device, or AP_MAX_FOREIGN of
   others, gets here, from record_stream, never a malloc or free. -1 (u unchanged) when the host
   has no memory left, or at the most. */
int ap_uses_grow(ap_block_uses *u, int foreign) {
    size_t cap = u->cap, fcap = u->fcap;
    if (foreign) fcap = fcap * 2 > AP_FOREIGN_LIMIT ? AP_FOREIGN_LIMIT : fcap * 2;
    else cap = cap * 2 > AP_MAX_STREAMS ? AP_MAX_STREAMS : cap * 2;
    if (cap == u->cap && fcap == u->fcap) return -1; /* uses: every slot already fits, not reached */
    size_t waits = cap + fcap + 1;
    void **mem = malloc((2 * waits + 2 * fcap) * sizeof(void *) + waits * sizeof(uint32_t) +
                        (cap + fcap) * sizeof(uint16_t));
    if (!mem) return -1;
    /* laid out as ap_uses_ok checks: events, owed, foreign, fevents, the event keys, then the
       16-bit arrays */
    uint32_t *keys = (uint32_t *)(mem + 2 * waits + 2 * fcap);
    uint16_t *uses = (uint16_t *)(keys + waits);
    int16_t *foreign_device = (int16_t *)(uses + cap);
    memcpy(mem, u->events, u->n_events * sizeof(void *));
    memcpy(keys, u->event_keys, u->n_events * sizeof(uint32_t));
    memcpy(mem + waits, u->owed, u->n_owed * sizeof(void *));
    memcpy(mem + 2 * waits, u->foreign, u->n_foreign * sizeof(void *));
    memcpy(mem + 2 * waits + fcap, u->fevents, u->n_fevents * sizeof(void *));
    memcpy(uses, u->uses, u->n_uses * sizeof(uint16_t));
    memcpy(foreign_device, u->foreign_device, u->n_foreign * sizeof(int16_t));
    if (u->events != u->events_in) free(u->events);
    u->events = mem;
    u->event_keys = keys;
    u->owed = mem + waits;
    u->foreign = mem + 2 * waits;
    u->fevents = mem + 2 * waits + fcap;
    u->uses = uses;
    u->foreign_device = foreign_device;
    u->cap = (uint16_t)cap;
    u->fcap = (uint16_t)fcap;
    return 0;
}

/* The grown arrays go back to the heap; the struct stays u (ap_pool_destroy, before the arena). */
void ap_uses_shrink(ap_block_uses *u) {
    if (u->events == u->events_in) return;
    free(u->events);
    uses_inline(u);
}

void ap_uses_recycle(ap_pool *p, ap_block_uses *u) {
    ap_uses_shrink(u);
    give(&p->spare_uses, u, sizeof(ap_block_uses));
}

void ap_arena_destroy(ap_pool *p) {
    for (size_t i = 0; i < p->n_chunks; i++) free(p->chunks[i]);
    free(p->chunks);
    p->chunks = NULL;
    p->n_chunks = p->chunks_cap = 0;
    p->spare_blocks = NULL;
    p->spare_segments = NULL;
    p->spare_uses = NULL;
}
