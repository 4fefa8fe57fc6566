"""The weight-sync daemon (`torchrun -m checkpoint_engine`): every rank runs a ParameterServer; rank 0
also serves the HTTP API, relays each command to the other ranks through the process group's store,
and heals failed engines.

    config         DaemonConfig: the daemon's flags (light: `--help` imports no torch)
    server         the daemon's ranks: start, serve, stop
    commands       what each rank runs for a command, and the check before relaying it
    driver         rank 0 runs commands one at a time, phase by phase
    relay          commands and their outcomes through the process group's store
    http           what every route shares (aiohttp app, errors, the credential)
    routes         our routes; compat_routes: MoonshotAI checkpoint-engine's `/v1` routes
    prometheus     `GET /metrics` (Prometheus text)
    heal           restart a failed engine and bring it to the newest weights
    store_wait     deadline waits on the store
"""
