"""`python -m orchestrator.long2short`: the same as `ckpt-long2short` (see cli.py)."""

import sys

from orchestrator.long2short.cli import main

sys.exit(main())
