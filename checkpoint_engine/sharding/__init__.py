"""Sending each engine rank less: only the slices it keeps (`shard_plan`, in the vocabulary of `slices`) and
only the values that changed since the version it holds (`delta`)."""
