"""What a process the RL job starts with multiprocessing's "spawn" runs first: SIGINT blocked.

vLLM's engine core and its workers (spawned, on CPU) are in the job's process group, so a terminal's
Ctrl-C reaches them too, and vLLM's engine core takes SIGINT for its own shutdown: a weight update in
flight then failed as a chain of EngineDeadErrors and the job printed tracebacks, not its stop line.
The job (``python -m orchestrator``) names this module as its main module's spec
(``orchestrator.__main__.spawn_children_through_here``); a spawned child runs the main module as
``__mp_main__`` before its target (multiprocessing skips a ``__main__`` module, hence a module of its
own). The signal mask holds through the handler vLLM installs and passes to the threads and forked
children started later, and to spawned ones through this module again. The job gets the Ctrl-C and
stops these processes itself, in order (SIGTERM); the reaper ends them if the job dies.
"""

from ckpt_common.procs import block_sigint

block_sigint()
