"""Evaluation of checkpoints: loading, frozen features, few-shot, k-NN, suites and comparison reports."""
