"""shoal.dashboard: the web dashboard of shoal (``shoal-dashboard``, started by ``shoal cluster
up`` and by compose/).

A Starlette application served by uvicorn. It is a client of the shoal API like the CLI: it
talks to the services only through :mod:`shoal.client`, with each logged-in user's own token,
so it holds no credential, has no path to etcd, and shows a user exactly what the API shows
them. It lives in the client distribution (``pip install 'shoal-client[dashboard]'``) for that
reason: it needs neither torch nor etcd, only the API. See docs/dashboard.md.
"""

from shoal.dashboard.app import create_app
from shoal.dashboard.config import DashboardConfig, parse_args

__all__ = ["DashboardConfig", "create_app", "parse_args"]
