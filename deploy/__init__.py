"""Real deployments: local processes (fedrl deploy local), the compose stack's helpers."""
