"""Residency: which revisions a node keeps loaded, as managed caches (tiers), apart from the I/O that moves them.

- `policy`: one node's on-demand slots as a pure cache object (W-TinyLFU with a cap per tenant): inputs are hits,
  misses, frequencies and capacities; outputs are the revisions to evict. The control plane rebuilds it from the
  database at each decision (serving/services/residency.py); the trace simulator (benchmarks/long_tail) and the
  unit tests run the same object.
- `frequency`: how often each revision was asked for lately, with aging: in memory for the simulator and tests,
  in Redis for the servers (every gateway process adds, the control plane reads).

No Django here: the simulator imports these modules without a database.
"""
