"""The volunteer SDK: give a machine's compute to a federation you do not operate.

    from fedrl.volunteer import Limits, join, load_invite
    join(load_invite("invite.txt"), limits=Limits(max_cpu=2, upload_kbps=2000), on_exit="flush")

`join` enrolls the node's key, probes the hardware, runs a SuperNode within the limits and
returns 0 after a clean withdrawal (Ctrl-C, SIGTERM, `until`, or `leave` from another process).
See fedrl.volunteer.session and fedrl.volunteer.withdrawal.
"""

__all__ = ["Limits", "join", "leave", "load_invite"]
_FROM = {
    "Limits": "fedrl.volunteer.probe",
    "join": "fedrl.volunteer.session",
    "leave": "fedrl.volunteer.withdrawal",
    "load_invite": "fedrl.invite",
}


def __getattr__(name: str):
    """Imported when first asked for: `join` and `Limits` bring torch and peft (seconds), which
    `fedrl volunteer status` and `leave` do without."""
    if name not in _FROM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_FROM[name]), name)
