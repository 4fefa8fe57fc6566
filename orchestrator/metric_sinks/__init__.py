"""Where the per-iteration metrics go besides DIR/metrics.jsonl (``orchestrator.metrics``).

sinks       the ``MetricsSink`` interface and its two kinds: TensorBoard event files, Weights & Biases
tb_events   TensorBoard's event-file format, written and read without TensorFlow or tensorboard
"""
