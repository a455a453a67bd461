"""Shards -> batches, one job per module (above `format` and `transforms`): shard URLs, their
expansion and checks (`urls`) -> tar members (`tar_reader`, with webdataset's openers) -> samples
(`samples`: images opened, judged and decoded, skips counted) -> the training and exact-pass streams
(`pipeline`), reading the epoch's global order (`epoch_order`), with JPEG decoding on the device
(`device_decode`). Their DataLoaders (`loaders`) and workers under job signals (`workers`); where a
training stream stands, for a checkpoint (`position`), and what it reads (`identity`); how mixed its
batches are (`class_mix`)."""
