"""Looking inside a checkpoint (ViT paper sec 4.5): attention distance and rollout, position- and
patch-embedding structure, masked predictions; `ssl-vit analyze` and the attention curves of
`ssl-vit compare`. Sits beside `ssl_vit.evaluation`, which imports it, never the reverse."""
