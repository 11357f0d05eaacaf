/* Block and segment structs come from chunks that are recycled, so the cached path never calls
 * malloc (a split needs a new block struct, a merge returns one). */
#include <stdlib.h>
#include <string.h>

#include "pool_internal.h"

#define CHUNK_BLOCKS 256

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

ap_block *ap_block_new(ap_pool *p) {
    if (!p->spare_blocks) {
        ap_block *chunk = new_chunk(p, CHUNK_BLOCKS * sizeof(ap_block));
        if (!chunk) return NULL;
        for (int i = 0; i < CHUNK_BLOCKS; i++) {
            chunk[i].next = p->spare_blocks;
            p->spare_blocks = &chunk[i];
        }
    }
    ap_block *b = p->spare_blocks;
    p->spare_blocks = b->next;
    memset(b, 0, sizeof *b);
    return b;
}

void ap_block_recycle(ap_pool *p, ap_block *b) {
    b->next = p->spare_blocks;
    p->spare_blocks = b;
}

ap_segment *ap_segment_new(ap_pool *p) {
    if (!p->spare_segments) {
        ap_segment *chunk = new_chunk(p, CHUNK_BLOCKS * sizeof(ap_segment));
        if (!chunk) return NULL;
        for (int i = 0; i < CHUNK_BLOCKS; i++) {
            chunk[i].next = p->spare_segments;
            p->spare_segments = &chunk[i];
        }
    }
    ap_segment *s = p->spare_segments;
    p->spare_segments = s->next;
    memset(s, 0, sizeof *s);
    s->seq = ++p->segment_seq;
    return s;
}

void ap_segment_recycle(ap_pool *p, ap_segment *s) {
    s->next = p->spare_segments;
    p->spare_segments = s;
}

ap_block_uses *ap_uses_new(ap_pool *p) {
    if (!p->spare_uses) {
        ap_block_uses *chunk = new_chunk(p, CHUNK_BLOCKS * sizeof(ap_block_uses));
        if (!chunk) return NULL;
        for (int i = 0; i < CHUNK_BLOCKS; i++) {
            chunk[i].next_spare = p->spare_uses;
            p->spare_uses = &chunk[i];
        }
    }
    ap_block_uses *u = p->spare_uses;
    p->spare_uses = u->next_spare;
    memset(u, 0, sizeof *u);
    return u;
}

void ap_uses_recycle(ap_pool *p, ap_block_uses *u) {
    u->next_spare = p->spare_uses;
    p->spare_uses = u;
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
