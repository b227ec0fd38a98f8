"""Byte units shared by the memory planner, the offload engine and every message that prints sizes."""
GIB = 2**30
