"""`python -m vllm_ext ...` is `python -m vllm_ext.launch ...` (fast-start launcher)."""

import sys

from vllm_ext.launch import main

if __name__ == "__main__":
    sys.exit(main())
