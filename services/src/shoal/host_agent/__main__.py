"""``python -m shoal.host_agent [flags]``: same as ``shoal-service host-agent``."""

import sys

from shoal.runtime.main import main

sys.exit(main(["host-agent", *sys.argv[1:]]))
