#include "free_tree.h"

#include "invariant.h"

/* Equal sizes are ordered by (segment age, offset), not by raw address, so that placement — and
   every figure of a replay — does not depend on where the device happened to map segments. */
static inline int key_less(const ap_block *a, const ap_block *b) {
    return a->size < b->size ||
           (a->size == b->size && (a->order != b->order ? a->order < b->order : a->addr < b->addr));
}

/* The treap's two invariants at node n, against its children only: search order by key (equal
   keys go right on insert and stay in that order through rotations) and heap order by priority.
   Asserted on every node an insert or remove passes, so a broken link is caught where it happens,
   at O(log n) cost. */
static inline int node_ok(const ap_block *n) {
    return (!n->left || (!key_less(n, n->left) && n->left->prio <= n->prio)) &&
           (!n->right || (!key_less(n->right, n) && n->right->prio <= n->prio));
}

static ap_block *rotate_right(ap_block *n) {
    ap_block *l = n->left;
    n->left = l->right;
    l->right = n;
    return l;
}

static ap_block *rotate_left(ap_block *n) {
    ap_block *r = n->right;
    n->right = r->left;
    r->left = n;
    return r;
}

static ap_block *insert_at(ap_block *n, ap_block *b) {
    if (!n) return b;
    if (key_less(b, n)) {
        n->left = insert_at(n->left, b);
        if (n->left->prio > n->prio) n = rotate_right(n);
    } else {
        n->right = insert_at(n->right, b);
        if (n->right->prio > n->prio) n = rotate_left(n);
    }
    AP_ASSERT(node_ok(n));
    return n;
}

/* Joins two treaps where every key of a precedes every key of b. */
static ap_block *join(ap_block *a, ap_block *b) {
    if (!a) return b;
    if (!b) return a;
    if (a->prio > b->prio) {
        a->right = join(a->right, b);
        return a;
    }
    b->left = join(a, b->left);
    return b;
}

static ap_block *remove_at(ap_block *n, ap_block *b, int *found) {
    if (!n) return NULL;
    if (n == b) {
        *found = 1;
        return join(n->left, n->right);
    }
    if (key_less(b, n)) n->left = remove_at(n->left, b, found);
    else n->right = remove_at(n->right, b, found);
    AP_ASSERT(node_ok(n));
    return n;
}

/* The priority is a hash of the address: deterministic runs, balanced in expectation. */
static inline uint32_t prio_of(uintptr_t addr) {
    uint64_t x = (uint64_t)addr * 0x9E3779B97F4A7C15ull;
    return (uint32_t)(x >> 32);
}

void ap_tree_insert(ap_free_tree *t, ap_block *b) {
    AP_ASSERT(b->size > 0 && b->addr >= b->seg->base && b->addr + b->size <= b->seg->base + b->seg->size);
    b->left = b->right = NULL;
    b->order = b->seg->seq; /* then the address: ap_block_before, without reading the segment */
    b->prio = prio_of(b->seg->seq << 40 ^ (uint64_t)(b->addr - b->seg->base)); /* a wrap only mixes priorities */
    t->root = insert_at(t->root, b);
    t->count++;
    t->bytes += b->size;
}

void ap_tree_remove(ap_free_tree *t, ap_block *b) {
    int found = 0;
    t->root = remove_at(t->root, b, &found);
    AP_ASSERT(found && t->count > 0 && t->bytes >= b->size); /* b was in this tree, with its size then */
    b->left = b->right = NULL;
    t->count--;
    t->bytes -= b->size;
}

ap_block *ap_tree_best_fit(const ap_free_tree *t, size_t size) {
    ap_block *n = t->root, *best = NULL;
    while (n) {
        if (n->size >= size) {
            best = n;
            n = n->left;
        } else {
            n = n->right;
        }
    }
    return best;
}

ap_block *ap_tree_largest(const ap_free_tree *t) {
    ap_block *n = t->root;
    if (!n) return NULL;
    while (n->right) n = n->right;
    return n;
}

static int walk_from(ap_block *n, size_t size, int (*fn)(ap_block *, void *), void *arg) {
    for (; n; n = n->right) /* a node below size has only smaller keys on its left */
        if (n->size >= size && (walk_from(n->left, size, fn, arg) || fn(n, arg))) return 1;
    return 0;
}

void ap_tree_walk_from(const ap_free_tree *t, size_t size, int (*fn)(ap_block *, void *), void *arg) {
    walk_from(t->root, size, fn, arg);
}

static void take_all(ap_block *n, ap_block ***tail) {
    while (n) {
        take_all(n->left, tail);
        ap_block *right = n->right;
        n->left = n->right = NULL;
        **tail = n;
        *tail = &n->pending_next;
        n = right;
    }
}

ap_block *ap_tree_take_all(ap_free_tree *t) {
    ap_block *head = NULL, **tail = &head;
    take_all(t->root, &tail);
    *tail = NULL;
    t->root = NULL;
    t->count = 0;
    t->bytes = 0;
    return head;
}

static void visit(ap_block *n, void (*fn)(ap_block *, void *), void *arg) {
    while (n) {
        visit(n->left, fn, arg);
        ap_block *right = n->right;
        fn(n, arg);
        n = right;
    }
}

void ap_tree_visit(const ap_free_tree *t, void (*fn)(ap_block *, void *), void *arg) {
    visit(t->root, fn, arg);
}

/* Walks n's subtree: every key between lo and hi (NULL: unbounded), heap order, and the blocks
   counted. 0 when something is out of place. */
static int check_at(const ap_block *n, const ap_block *lo, const ap_block *hi, size_t *count, size_t *bytes) {
    for (; n; n = n->right) { /* the right spine iteratively: a skewed tree must not overflow the stack */
        if ((lo && key_less(n, lo)) || (hi && key_less(hi, n)) || !node_ok(n)) return 0;
        if (!check_at(n->left, lo, n, count, bytes)) return 0;
        (*count)++;
        *bytes += n->size;
        lo = n;
    }
    return 1;
}

int ap_tree_check(const ap_free_tree *t) {
    size_t count = 0, bytes = 0;
    return check_at(t->root, NULL, NULL, &count, &bytes) && count == t->count && bytes == t->bytes;
}
