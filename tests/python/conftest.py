"""Shared setup: the emu backend everywhere, and this directory importable (models.py)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.pop("SPILLWAY_CONF", None)  # the tests set every option they rely on
