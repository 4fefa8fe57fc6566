"""A stand-in for a vLLM process killed with SIGKILL: it maps a named shared-memory segment it never
removes, writes the segment's name to the file in argv[1], then waits. Run with `python -c LEAKY_ENGINE`."""

LEAKY_ENGINE = (
    "import sys, time\n"
    "from multiprocessing import resource_tracker, shared_memory\n"
    "seg = shared_memory.SharedMemory(create=True, size=4096)\n"
    "resource_tracker.unregister(seg._name, 'shared_memory')\n"
    "open(sys.argv[1], 'w').write(seg.name)\n"
    "time.sleep(120)\n"
)
