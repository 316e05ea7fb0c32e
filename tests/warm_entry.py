"""What a warm launcher's child runs in tests/test_warm_clientapp.py instead of Flower's
`flwr-clientapp`: it reports what the launching process handed over, then exits as asked."""

import os
import signal
import sys
import time


def report() -> None:
    args = sys.argv[1:]
    if args[:1] == ["wait"]:  # before the line that tells the test to signal
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(7))
    line = sys.stdin.readline().strip()
    fresh = signal.getsignal(signal.SIGINT) is signal.default_int_handler  # as in a new Python
    fresh = fresh and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    print(f"argv={args} probe={os.environ.get('PROBE')} cwd={os.getcwd()} stdin={line} fresh={fresh}")
    print(f"pid={os.getpid()}")
    print("on stderr", file=sys.stderr, flush=True)
    sys.stdout.flush()
    if args[:1] == ["wait"]:
        time.sleep(60)
    if args[:1] == ["raise"]:
        raise RuntimeError("the app failed")
    sys.exit(int(args[0]) if args and args[0].isdigit() else 0)
