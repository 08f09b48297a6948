/* The routing table: real driver entry points -> the shim's wrappers (see ledger.h). A linear
 * table: it holds a few dozen entries and is searched only when a program resolves a symbol. */
#include "ledger.h"

int spwp_routes_add(spwp_routes *t, const void *real, void *wrap) {
    if (!real || real == wrap) return 1;
    for (size_t i = 0; i < t->n; i++)
        if (t->e[i].real == real) return 1;
    if (t->n >= SPWP_ROUTES_MAX) return -1;
    t->e[t->n].real = real;
    t->e[t->n].wrap = wrap;
    t->n++;
    return 0;
}

void *spwp_routes_find(const spwp_routes *t, const void *real) {
    if (!real) return NULL;
    for (size_t i = 0; i < t->n; i++)
        if (t->e[i].real == real) return t->e[i].wrap;
    return NULL;
}
