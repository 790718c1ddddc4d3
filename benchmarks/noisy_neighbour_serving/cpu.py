"""Where the machine's CPU time goes in a window: seconds of CPU per part of the stack, from /proc via psutil.

A ratio of B's latencies says that a flood costs B something; these say which part of the stack paid it
(the gateway, vLLM's API server, its engine core, the workers, the database, A's own client).
"""

from __future__ import annotations

import psutil

# The machine's backing servers, by process name.
_BACKING = {"postgres": "postgres", "redis-server": "redis"}


def _tree_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of a process and of each of its descendants, by pid (gone processes are skipped)."""
    seconds: dict[str, float] = {}
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return seconds
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        seconds[str(process.pid)] = times.user + times.system
    return seconds


def snapshot(parts: dict[str, int], *, split: tuple[str, ...] = ()) -> dict[str, dict[str, float]]:
    """CPU seconds so far of each named part (a process and its descendants) and of the backing servers; a part
    named in `split` is counted as `<name>_root` (the process itself) and `<name>_children` (its descendants),
    vLLM's API server apart from its engine core, say."""
    out: dict[str, dict[str, float]] = {}
    for name, pid in parts.items():
        tree = _tree_seconds(pid)
        if name in split:
            out[f"{name}_root"] = {p: s for p, s in tree.items() if p == str(pid)}
            out[f"{name}_children"] = {p: s for p, s in tree.items() if p != str(pid)}
        else:
            out[name] = tree
    for process in psutil.process_iter(["name", "cpu_times"]):
        part = _BACKING.get(process.info["name"] or "")
        if part and process.info["cpu_times"] is not None:
            times = process.info["cpu_times"]
            out.setdefault(part, {})[str(process.pid)] = times.user + times.system
    return out


def used(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], seconds: float) -> dict[str, float]:
    """CPU used between two snapshots, per part, as a share of one CPU over `seconds` (1.0 = one CPU busy).

    A process that started in between counts from zero; one that ended in between is lost (a few ms).
    """
    shares = {}
    for part, now in after.items():
        then = before.get(part, {})
        spent = sum(max(0.0, s - then.get(pid, 0.0)) for pid, s in now.items())
        shares[part] = round(spent / seconds, 3)
    return shares
