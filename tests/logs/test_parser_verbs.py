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
