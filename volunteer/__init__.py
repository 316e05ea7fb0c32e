"""The volunteer SDK: give a machine's compute to a federation you do not operate.

    from fedrl.volunteer import Limits, join, load_invite
    join(load_invite("invite.txt"), limits=Limits(max_cpu=2, upload_kbps=2000), on_exit="flush")

`join` enrolls the node's key, probes the hardware, runs a SuperNode within the limits and
returns 0 after a clean withdrawal (Ctrl-C, SIGTERM, or `until`). See fedrl.volunteer.session.
"""

from fedrl.invite import load_invite
from fedrl.volunteer.probe import Limits
from fedrl.volunteer.session import join

__all__ = ["Limits", "join", "load_invite"]
