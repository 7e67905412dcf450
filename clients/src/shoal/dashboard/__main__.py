"""``shoal-dashboard``: serve the dashboard with uvicorn until SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from shoal.client.config import ConfigError
from shoal.contract import environment


def main(argv: Sequence[str] | None = None) -> int:
    import uvicorn

    from shoal.dashboard.app import create_app
    from shoal.dashboard.config import parse_args

    logging.basicConfig(
        level=os.environ.get(environment.LOG_LEVEL, "INFO").upper(),
        format="%(asctime)s %(levelname)s dashboard %(name)s: %(message)s",
    )
    try:
        config = parse_args(argv)
    except ConfigError as exc:
        print(f"shoal-dashboard: error: {exc}", file=sys.stderr)
        return 2
    app = create_app(config)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            ssl_certfile=config.tls_cert,
            ssl_keyfile=config.tls_key,
            access_log=config.access_log,
            log_config=None,  # the logging set up above
            server_header=False,
            proxy_headers=False,
            timeout_graceful_shutdown=5,
        )
    )
    scheme = "https" if config.https else "http"
    logging.getLogger("shoal.dashboard").info(
        "dashboard on %s://%s:%d/ (scheduler %s)",
        scheme,
        config.host,
        config.port,
        ",".join(config.scheduler),
    )
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
