#!/usr/bin/env python3
"""Write varcyclic48.access: inference over 48 read-only layers of 16-96 MiB (multiples of
4 MiB), visited in the same order every step, each with one small activation buffer, 6 steps.
The sizes come from a fixed linear congruential generator, so the file is the same on every
machine and Python version:

    python3 tests/data/gen_varcyclic.py > tests/data/varcyclic48.access
"""
import sys

LAYERS, STEPS, MIB = 48, 6, 1 << 20
ACT = 4 * MIB


def sizes(seed=12345):
    x = seed
    for _ in range(LAYERS):
        x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        yield (16 + 4 * ((x >> 33) % 21)) * MIB  # 16, 20, ..., 96 MiB


def main(out=sys.stdout):
    out.write("# spillway access trace v1\n")
    out.write(f"# {LAYERS} read-only layers of 16-96 MiB in a fixed cycle, {STEPS} steps "
              "(tests/data/gen_varcyclic.py)\n")
    for i, b in enumerate(sizes()):
        out.write(f"b {i} {b} ro\n")
    out.write(f"b {LAYERS} {ACT} rw\n")
    for _ in range(STEPS):
        out.write("s\n")
        for i in range(LAYERS):
            out.write(f"a {i}:r {LAYERS}:rw\n")


if __name__ == "__main__":
    main()
