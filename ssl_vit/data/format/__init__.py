"""The shard format and its limits, what every reader and writer of shards agrees on (the bottom of
`ssl_vit.data`, importing nothing above it): the members of a sample and the limits they are judged by
(`members`: image and label members, `parse_label`, `BadSample`, `MAX_CLASSES`, `MAX_IMAGE_PIXELS`,
`Bands`), `.npy`/TIFF/16-bit PNG members as arrays (`arrays`), segmentation masks (`masks`: `seg.png`,
`read_mask`), per-band statistics (`band_stats`) and the split's manifest, `{split}.json` (`manifest`)."""
