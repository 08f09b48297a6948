/* Fixture for check_layers.sh: an arena that calls up into the context (must be reported). */
int spw__ctx_can_hold(int more);
int spw__fixture_arena_grow(int more) { return spw__ctx_can_hold(more); }
