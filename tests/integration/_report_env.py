"""A learner that prints its environment contract as JSON on stdout, a line on stderr, and
exits with the code given as its first argument."""

import json
import os
import sys

names = [
    "SHOAL_JOB_ID",
    "SHOAL_LEARNER_ID",
    "SHOAL_HOST_ID",
    "SHOAL_DEVICE_ID",
    "SHOAL_ALLOCATION_ID",
    "SHOAL_SERVICE_TOKEN",
    "CUDA_VISIBLE_DEVICES",
    "TRACEPARENT",
    "FOO",
]
print(json.dumps({name: os.environ.get(name) for name in names}))
print("cwd", os.path.basename(os.getcwd()), sorted(os.listdir(".")))
print("environment", json.dumps(sorted(os.environ.items())), json.dumps(sys.argv))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
