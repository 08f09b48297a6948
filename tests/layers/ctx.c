/* Fixture for check_layers.sh: the context the fixture arena calls. */
int spw__ctx_can_hold(int more) { return more < 4; }
