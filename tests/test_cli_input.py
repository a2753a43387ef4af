"""Option input as a user gives it: environment variables, help, completion, plurals and
piped tables, through ``kvctl`` as typed (in-process, not a terminal)."""

from __future__ import annotations

import pytest
from inprocess import run_main


@pytest.mark.parametrize("variable,value,args,message", [
    ("KVCTL_TAP_COUNT", "abc", ["tap", "tcp://127.0.0.1:1"], "'abc' is not a valid integer"),
    ("KVCTL_SIMULATE_WORKERS", "0", ["simulate"], "0 is not in the range x>=1"),
    ("KVCTL_TAP_AS_JSON", "maybe", ["tap", "tcp://127.0.0.1:1"], "'maybe' is not a valid bool"),
    ("KVCTL_NATS_CREDS", ".", ["tap", "nats://127.0.0.1:1"], "'.' is a directory"),
])
def test_invalid_environment_variable_is_named(variable, value, args, message):
    result = run_main(*args, env={variable: value})
    assert result.code == 2
    assert result.err.splitlines() == [result.err.strip()], result.err  # one line
    assert result.err.startswith(f"kvctl: {variable}: ") and message in result.err, result.err


def test_invalid_option_on_the_command_line_still_names_the_option():
    result = run_main("tap", "tcp://127.0.0.1:1", "-c", "abc")
    assert result.code == 2 and "'-c' / '--count'" in result.err and "KVCTL_" not in result.err
