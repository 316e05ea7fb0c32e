"""The `fedrl` command, on top of every layer."""
