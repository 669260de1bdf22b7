"""The common verbs parse_line matches with the header (issue 44): the same event as the
rules give, trailing whitespace or not, and where more follows the match (a newline inside
the line, text after the verb), the rules' answer, never the verb's."""

from __future__ import annotations

from mps_exporter.logs import events as ev
from mps_exporter.logs.parser import parse_line

from .helpers import UTC

C = "[2026-11-21 04:22:16.630 Control  1419] "
S = "[2026-11-21 04:23:08.506 Server  2736] "


def c(msg: str) -> ev.ParseResult:
    return parse_line(C + msg, "control", UTC)


def s(msg: str) -> ev.ParseResult:
    return parse_line(S + msg, "server", UTC)


def test_a_verb_with_trailing_whitespace_is_the_verb():
    assert c("Cmd: get_server_status 4000 \t ") == c("Cmd: get_server_status 4000")
    assert c("Cmd: get_server_status 4000 \t ")[2:] == ("get_server_status", "4000")
    assert c("NEW CLIENT 7 from user 0: Server already exists \u3000")[2:] == (7, 0)
    assert c("4000    0   4000   GPU-a2 x  ")[2:] == ("4000    0   4000   GPU-a2 x",)
    assert c("4000 ")[2:] == ("4000",)
    assert s("Client {PID: 7, Context ID: 0} connected \r")[2:] == (7,)
    assert s("Status of client {PID: 7, Context: 1} is ACTIVE\t") == ev.ClientContextActive(*s("Status of client {PID: 7, Context: 1} is ACTIVE")[:2], 7)


def test_more_after_a_verb_gives_the_rules_answer():
    assert c("Cmd: ps a\nb") == ev.Unrecognized(*c("Cmd: ps")[:2], "bad Cmd line")
    assert c("Cmd: ps\n  x")[2:] == ("ps", "x")
    assert type(s("Client {PID: 7, Context ID: 0} connected twice")) is ev.Unrecognized
    assert type(s("Client process 7 disconnected\nagain")) is ev.Unrecognized
    assert c("12 x") == ev.Unrecognized(*c("12")[:2], "no control rule matched")
    assert s("Received new client request\nfor {PID: 7}") == ev.Noise(*s("Startup")[:2], "client_request")


def test_a_long_line_that_fails_a_verb_is_parsed_by_the_rules():
    # `.*\s*\Z` in the line's pattern took 40 s for the first of these (32 KB): checked now after it.
    spaces = " \u3000" * 16000
    assert c("Cmd: x y" + spaces + "z\nw") == ev.Unrecognized(*c("Cmd: x")[:2], "bad Cmd line")
    assert type(c("NEW CLIENT 1 from user 2: a" + spaces + "y\nq")) is ev.Unrecognized
    assert type(s("Client {PID: 1, Context ID: 0} exiting a" + spaces + "y\nq")) is ev.Noise


def test_a_servers_life_in_control_log_is_what_the_rules_say():
    """`Try shutting down`, `Starting new server`, `NEW SERVER ... Ready`, `Server ... exited`:
    matched with the header, the same event as the rules build from the message alone, for
    the verb, near misses, trailing blanks, more text, too many digits and other digits."""
    from mps_exporter.logs import parser

    ts, pid = c("Start")[:2]
    arabic = str.maketrans("0123456789", "\u0660\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669")
    messages = []
    for msg in ("Try shutting down server 654, backoff is disabled", "Try shutting down server 654",
                "Try shutting down server 12345678901, backoff", "Try shutting down server x",
                "Starting new server 654 for user 0", "Starting new server 654 for user 1500 now",
                "Starting new server 654 for user 12345678901", "Starting control daemon using socket /tmp",
                "NEW SERVER 654: Ready", "NEW SERVER 654: Ready or not", "NEW SERVER 654: ready",
                "NEW CLIENT 7 from user 0: Server is not ready, push client to pending list",
                "Server 654 exited with status 0", "Server 654 exited with status -9",
                "Server 654 exited with status 12345678901", "Server 654 exited with status 0 twice",
                "Server 654 has 2 active worker threads. Server will not shutdown.", "Server 654 not found"):
        messages += [msg, msg + " \t", msg + "\nmore", msg.translate(arabic)]
    for msg in messages:
        want = parser._parse_control(ts, pid, msg.rstrip())
        got = c(msg)
        assert got == want and type(got) is type(want), msg
    assert type(c("NEW SERVER 654: Ready")) is ev.ServerReady
    assert c("Server 654 exited with status -9")[2:] == (654, -9)
    assert c("Starting new server 654 for user 1500")[2:] == (654, 1500)
    assert c("Try shutting down server 654, backoff is enabled")[2:] == (654,)
