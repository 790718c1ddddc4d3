"""vLLM flags of a node's engine that MinT acts on, apart from Django so that the tooling that starts engines
(devtools/launcher.py, benchmarks) names the same ones as a node's `engine_flags` (serving/models.py)."""

# The engine schedules by each request's `priority` (lower first; 0 when a request names none, as the gateway's
# never do): evaluations are sent below every tenant's inference (serving/services/evaluation.py).
PRIORITY_SCHEDULING_FLAG = "--scheduling-policy=priority"
