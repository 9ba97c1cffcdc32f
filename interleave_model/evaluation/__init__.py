"""Score answers: the word alignment, the torchmetrics Metric, pass@k and sampled answers, reports."""
