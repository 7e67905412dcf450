"""A learner that ignores SIGTERM and has a child that ignores it too (for StopLearner and
agent-death tests). Prints "ready <pid> <child pid>" once both run, then waits to be killed."""

import os
import signal
import subprocess
import sys
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen(
    [
        sys.executable,
        "-c",
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "while True:\n"
        "    time.sleep(1)\n",
    ]
)
print(f"ready {os.getpid()} {child.pid}", flush=True)
while True:
    time.sleep(1)
