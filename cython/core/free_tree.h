/* Best-fit index of free blocks: an intrusive treap ordered by (size, segment age, offset).
 * O(log n) expected per operation, no allocation (links live in the blocks). Best fit is the
 * smallest block of at least the wanted size, oldest segment and lowest offset first among equals,
 * which keeps allocations packed into old segments and young ones free for release. */
#ifndef AP_FREE_TREE_H
#define AP_FREE_TREE_H

#include "block.h"

typedef struct ap_free_tree {
    ap_block *root;
    size_t count;
    size_t bytes;
} ap_free_tree;

void ap_tree_insert(ap_free_tree *t, ap_block *b);
void ap_tree_remove(ap_free_tree *t, ap_block *b);
/* Smallest block with size >= size, or NULL. */
ap_block *ap_tree_best_fit(const ap_free_tree *t, size_t size);
/* Largest block, or NULL. */
ap_block *ap_tree_largest(const ap_free_tree *t);
/* Calls fn on the blocks of at least size bytes, in tree order, until fn returns nonzero; fn must
   not modify the tree. */
void ap_tree_walk_from(const ap_free_tree *t, size_t size, int (*fn)(ap_block *, void *), void *arg);
/* Empties the tree in O(n): its blocks, linked through pending_next in tree order (NULL-ended).
   Removing them one by one (root first) cost a join and, reinserted in the reverse of that order,
   a rotation up to the root each: retagging a stream's million free blocks took 10 s. */
ap_block *ap_tree_take_all(ap_free_tree *t);
/* Calls fn for every block (in order); fn must not modify the tree. */
void ap_tree_visit(const ap_free_tree *t, void (*fn)(ap_block *, void *), void *arg);
/* Full check, O(n): search and heap order at every node, count and bytes equal to the blocks held.
   1 when all hold. For check.c and the C unit tests, never on a hot path. */
int ap_tree_check(const ap_free_tree *t);

#endif
