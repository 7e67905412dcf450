"""``python -m shoal.param_sync [flags]``: one parameter-sync shard."""

import sys

from shoal.param_sync.main import main

if __name__ == "__main__":
    sys.exit(main())
