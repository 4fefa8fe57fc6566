"""Where the per-iteration metrics go besides DIR/metrics.jsonl (``orchestrator.metrics``).

sinks       the ``MetricsSink`` interface and its two kinds: TensorBoard event files (tensorboardX),
            Weights & Biases
"""
