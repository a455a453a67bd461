"""The report stage of `ssl-vit evaluate` and `compare`: tables, paired differences and verdicts, plots,
the writer of the output directory, and `compare`, which has the ranks evaluate and then writes. It
reads the ranks' records and per-image statistics (intervals over a group's runs and paired differences
need every rank's), and loads no checkpoint and reads no shard."""
