"""Alias for old command lines: `python -m orchestrator.sandbox` runs `python -m sandbox` (moved to sandbox/)."""

import sys

from sandbox.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
