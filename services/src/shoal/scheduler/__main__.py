"""``python -m shoal.scheduler``: run the job-scheduler (see ``shoal.scheduler.main``)."""

import sys

from shoal.scheduler.main import main

sys.exit(main())
