"""Where the per-iteration metrics go besides DIR/metrics.jsonl (``orchestrator.metrics_log``).

sinks       the ``MetricsSink`` interface and its two kinds: TensorBoard event files (tensorboardX),
            Weights & Biases
"""
