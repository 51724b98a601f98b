"""The paged KV cache: pool memory, block bookkeeping, per-sequence block tables, prefix hashes.

One concept per file:
- pool.py: the tensors, allocated once on the worker's device;
- blocks.py: which blocks are free, who holds them, which hold a cached prefix;
- block_table.py: one sequence's blocks, in position order, and the slots they give;
- prefix.py: the chained hashes that address full blocks for the prefix cache.
"""
