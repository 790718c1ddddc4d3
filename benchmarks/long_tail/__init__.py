"""Long tail: serving a catalog far larger than the nodes' slots, with residency tiers (issue 28).

Two parts, one results file (benchmarks/results/long_tail.json):

1. A trace-driven simulator (`sim`, `trace`, `offline`): the control plane's own placement and eviction code
   (serving/residency/: NodeCache, choose_node, LocalCounts) over a synthetic trace of 10^7 requests for 10^6
   adapters in Zipf-sized tenants on 100 nodes, with drift and scans; its hit ratio against plain LRU and
   Belady's optimum, and its decisions per second on one core. Keys `sim_*`.
2. A live run (`live`, `catalog`, `clients`, `stall`, `figures`): 10,000 live aliases over 100 tenants on the
   local vLLM CPU node with GPU 4 / CPU 16 / disk 256 adapters, a Zipf stream through the official `openai`
   client, a scan and a thrashing phase; success, cold starts, `Retry-After` honesty, hit ratios per tier
   against LRU and Belady replays, the hot tenant's latency during the scan, and the engine's stall when
   adapters load or page.

    python -m benchmarks.long_tail [--quick] [--only sim|live]
"""
