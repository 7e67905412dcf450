"""Config, tokens file and trace-context propagation: validation names the field and the value."""

from __future__ import annotations

import subprocess
import sys

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from shoal.runtime import telemetry
from shoal.runtime.auth import Role, TokenTable, new_token
from shoal.runtime.config import ServerConfig, parse_server_config
from shoal.runtime.errors import InvalidField


def test_flags_override_environment_variables(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("")
    env = {
        "SHOAL_LISTEN": "0.0.0.0:7000",
        "SHOAL_TOKENS_FILE": str(tokens),
        "SHOAL_ETCD_ENDPOINTS": "a:1,b:2",
    }
    config = parse_server_config("svc", ["--listen", "127.0.0.1:7100"], env)
    assert config.listen == "127.0.0.1:7100"
    assert config.tokens_file == str(tokens)
    assert config.etcd_endpoints == ("a:1", "b:2")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--listen", "nowhere"], "listen ('nowhere') must be HOST:PORT"),
        (["--listen", "h:99999"], "listen ('h:99999') port must be in 0..65535"),
        (["--max-message-mb", "lots"], "max_message_mb ('lots') must be a number"),
        (["--max-message-mb", "0.1"], "max_message_bytes (104857) must be 1..1024 MiB"),
        (
            ["--tokens-file", "/no/such/file"],
            "tokens_file ('/no/such/file') is not a readable file",
        ),
        ([], "tokens_file (None) is required"),
        (["--insecure-no-auth", "--etcd", "x"], "etcd_endpoints ('x') must be HOST:PORT"),
        (["--insecure-no-auth", "--tls-cert", "c.pem"], "needs both --tls-cert and --tls-key"),
    ],
)
def test_bad_config_is_rejected_with_the_field_and_the_value(argv, needle):
    with pytest.raises(InvalidField) as info:
        parse_server_config("svc", argv, {})
    assert needle in str(info.value)


def test_config_is_frozen():
    config = ServerConfig(service_name="s", allow_no_auth=True)
    with pytest.raises(AttributeError):
        config.listen = "x:1"  # type: ignore[misc]


def test_tokens_file_accepts_plain_and_hashed_tokens_and_rejects_bad_roles():
    plain, hashed = new_token(), new_token()
    import hashlib

    digest = hashlib.sha256(hashed.encode()).hexdigest()
    table = TokenTable.parse(f"# comment\n{plain} alice user\nsha256:{digest} sched service\n")
    assert table.authenticate(plain).name == "alice"
    assert table.authenticate(hashed).role is Role.SERVICE
    assert table.authenticate("nope") is None
    with pytest.raises(InvalidField, match=r"role at <tokens>:1 \('root'\)"):
        TokenTable.parse(f"{plain} alice root\n")
    with pytest.raises(InvalidField, match="must be 'TOKEN PRINCIPAL ROLE'"):
        TokenTable.parse("justonefield\n")


CHILD = """
from opentelemetry import trace
from shoal.runtime import telemetry
ctx = trace.get_current_span(telemetry.extract_env()).get_span_context()
print(f"{ctx.trace_id:032x}")
"""


def test_trace_context_crosses_into_a_child_process_through_traceparent():
    provider = TracerProvider()
    with provider.get_tracer("t").start_as_current_span("parent") as span:
        env = telemetry.inject_env({})
        trace_id = f"{span.get_span_context().trace_id:032x}"
    assert env["TRACEPARENT"].split("-")[1] == trace_id
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == trace_id
    assert trace.get_current_span().get_span_context().is_valid is False
