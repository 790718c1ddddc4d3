"""A supervising process like `make run`'s launcher, with children that ignore SIGTERM (a task that hangs).

`python -m tests.devtools.hung_children <log dir> <grace s>`: reports the SIGINT disposition it
inherited, starts the children, says `ready`, and waits as the launcher does until a stop signal.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from devtools.supervisor import Supervisor


def main() -> int:
    log_dir, grace = Path(sys.argv[1]), float(sys.argv[2])
    inherited = "ignored" if signal.getsignal(signal.SIGINT) == signal.SIG_IGN else "handled"
    print(f"inherited SIGINT: {inherited}", flush=True)
    supervisor = Supervisor(log_dir)
    supervisor.stop_on_signals()
    try:
        # Ignored signals are inherited: the shell and both of its sleeps shrug off SIGTERM.
        supervisor.start("hung", ["sh", "-c", "trap '' TERM; sleep 600 & sleep 600"])
        supervisor.start("plain", ["sleep", "600"])
        print("ready", flush=True)
        supervisor.watch(interval=0.1)
        return 1
    except KeyboardInterrupt:
        print("stopping", flush=True)
        return 0
    finally:
        supervisor.stop_all(timeout=grace)


if __name__ == "__main__":
    sys.exit(main())
