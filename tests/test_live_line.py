import io

from rich.console import Console

from fedrl.live_line import LiveLine


def test_in_a_log_a_status_is_written_again_only_when_it_changes():
    """`fedrl deploy local` wrote its status with a carriage return every 2 s poll, into logs too."""
    out = io.StringIO()
    line = LiveLine(Console(file=out, force_terminal=False, width=200))
    for text in ["run 1: running, last checkpoint none yet"] * 3 + [
        "run 1: running, last checkpoint [v4]"
    ] * 2:
        line.show(text)
    line.done()
    assert (
        out.getvalue() == "run 1: running, last checkpoint none yet\nrun 1: running, last checkpoint [v4]\n"
    )


def test_on_a_terminal_the_line_is_rewritten_in_place_and_closed_once():
    out = io.StringIO()
    line = LiveLine(Console(file=out, force_terminal=True))
    line.show("connecting ...")
    line.show("connecting ...")
    line.show("node 7 | connected")
    line.done()
    line.done()  # nothing open: no second newline
    assert out.getvalue() == "\r\033[Kconnecting ...\r\033[Knode 7 | connected\n"
