"""The engine process attached to each parameter-server rank, and its lifecycle.

host            the daemon's `--engine-cmd` engines on this rank: start, update, stop
config          what each rank's engine runs (the command template and its fields)
process         one engine process: free port, log, readiness, watchdog
states          the lifecycle states and their pure transition table
segment_ledger  shared-memory segments an engine tree maps, cleaned at the next start
plain           a plain engine process (named weights in memory; the CUDA checks' engine)
"""
