"""dmuon's benchmarks, sorted by what they measure (``benchmarks/README.md``).

A package only so that the scripts reach the helpers they share (``_common``, ``_host_profile``)
and each other's building blocks by one explicit name (``from benchmarks import _common``,
``from benchmarks.e2e import bench_e2e``) without colliding with installed top-level modules
(``kernels`` is a Hugging Face package). Nothing is imported here.
"""
