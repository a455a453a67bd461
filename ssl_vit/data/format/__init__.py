"""The shard format and its limits, what every reader and writer of shards agrees on (the bottom of
`ssl_vit.data`, importing nothing above it): the members of a sample and the limits they are judged by
(`members`), `.npy`/TIFF/16-bit PNG members as arrays (`arrays`), segmentation masks (`masks`), per-band
statistics (`band_stats`) and the split's manifest, `{split}.json` (`manifest`)."""
