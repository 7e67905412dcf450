"""shoal.cli: the ``shoal`` command."""

import os

# gRPC's C core logs each failed TLS handshake at INFO on stderr; the CLI's errors are one line
# (the client explains a TLS failure itself), so only gRPC's errors are shown.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
