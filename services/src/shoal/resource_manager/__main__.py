"""``python -m shoal.resource_manager [flags]``: same as ``shoal-service resource-manager``."""

import sys

from shoal.runtime.main import main

sys.exit(main(["resource-manager", *sys.argv[1:]]))
